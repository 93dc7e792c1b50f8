"""Paged KV cache, the host's bookkeeping: ``block_pool`` (reference-counted blocks, free list,
evictable LRU), ``prefix_cache`` (radix tree of full blocks), ``manager`` (``KVCacheManager``:
per-request block tables, prefix matching, forks with copy-on-write; the scheduler's API),
``kv_groups`` (``KVCacheGroups``: which layers share a block table, by their KV-cache spec:
``jaxinfer/model/kv_specs.py``, re-exported here),
``cache_config`` (the flags). The device side is ``jaxinfer/worker/kv``.
"""

from jaxinfer.core.kv_cache.block_pool import BlockPool, OutOfBlocksError
from jaxinfer.core.kv_cache.cache_config import CacheConfig, add_cache_arguments, resolve_kv_cache_dtype
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups
from jaxinfer.core.kv_cache.manager import KVCacheManager
from jaxinfer.core.kv_cache.prefix_cache import PrefixCacheStats
from jaxinfer.model.kv_specs import (AttentionSpec, ChunkedLocalAttentionSpec, FixedStateSpec,
                                     FullAttentionSpec, KVCacheSpec, MLAAttentionSpec,
                                     SlidingWindowSpec)

__all__ = [
    "BlockPool", "OutOfBlocksError", "CacheConfig", "add_cache_arguments", "resolve_kv_cache_dtype",
    "KVCacheGroups", "KVCacheManager", "PrefixCacheStats", "AttentionSpec",
    "ChunkedLocalAttentionSpec", "FixedStateSpec", "FullAttentionSpec", "KVCacheSpec",
    "MLAAttentionSpec", "SlidingWindowSpec",
]
