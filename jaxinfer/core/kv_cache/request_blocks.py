"""A request's block tables in the KVCacheManager (manager.py), and what its mixins keep beside
them: the prefix-cache position, fork family, state snapshots and a verifying step's copy."""

from __future__ import annotations

import itertools

# Versions of request tables (table_version), unique across requests and managers.
_TABLE_VERSIONS = itertools.count()


class RequestBlocks:
    """One request's block tables and what the manager's mixins keep beside them."""

    __slots__ = ("tables", "skipped", "num_tokens", "num_cached_blocks", "cache_node", "family",
                 "counted", "snapshot", "resume", "verify", "version")

    def __init__(self, tables: list[list[int]], skipped: list[int], num_tokens: int,
                 num_cached_blocks: int, cache_node, family: set[RequestBlocks] | None = None):
        self.tables = tables                  # per group: physical blocks, logical order
        self.skipped = skipped                # per group: leading entries no longer held
        self.num_tokens = num_tokens          # tokens with a slot (computed or scheduled)
        self.num_cached_blocks = num_cached_blocks  # leading blocks registered in the prefix cache
        self.cache_node = cache_node          # tree node of the last of those (root if none)
        # Live requests related by fork (shared set), None if never forked: the only other
        # holders of this request's uncached blocks, which a dedup must update too.
        self.family = family
        # What its prefix lookup added to `stats`, [queries, hits], while it can be taken back.
        self.counted: list[int] | None = None
        # A fixed state's snapshot taken, not yet registered: (block k, group -> its blocks);
        # the matched snapshots the state pages start from, group -> blocks (state_snapshots.py).
        self.snapshot: tuple[int, dict[int, list[int]]] | None = None
        self.resume: dict[int, tuple[int, ...]] | None = None
        # A verifying step's copy of the state: (start, end, group -> spare blocks)
        # (state_rollback.py).
        self.verify: tuple[int, int, dict[int, list[int]]] | None = None
        self.version = next(_TABLE_VERSIONS)

    def edited(self) -> None:
        """An entry was replaced or dropped (not appended): the tables' next version."""
        self.version = next(_TABLE_VERSIONS)
