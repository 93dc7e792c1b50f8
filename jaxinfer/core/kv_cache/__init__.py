"""Paged KV cache.

Host side: ``block_pool`` (reference-counted blocks, free list, evictable LRU), ``prefix_cache``
(radix tree of full blocks), ``manager`` (``KVCacheManager``: per-request block tables, prefix
matching, forks with copy-on-write; the scheduler's API). Device side: ``device_cache``
(``allocate_kv_cache``, ``copy_blocks``). Sizing: ``cache_config`` (flags) and ``planner``.
"""

from jaxinfer.core.kv_cache.block_pool import BlockPool, OutOfBlocksError
from jaxinfer.core.kv_cache.cache_config import CacheConfig, add_cache_arguments, resolve_kv_cache_dtype
from jaxinfer.core.kv_cache.device_cache import KVCache, allocate_kv_cache, copy_blocks
from jaxinfer.core.kv_cache.manager import KVCacheManager, PrefixCacheStats
from jaxinfer.core.kv_cache.planner import (KVCachePlan, MemoryPlanError, activation_peak_bytes,
                                       device_memory_bytes, kv_bytes_per_token, plan_kv_cache,
                                       tree_nbytes)

__all__ = [
    "BlockPool", "OutOfBlocksError", "CacheConfig", "add_cache_arguments", "resolve_kv_cache_dtype",
    "KVCache", "allocate_kv_cache", "copy_blocks", "KVCacheManager", "PrefixCacheStats",
    "KVCachePlan", "MemoryPlanError", "activation_peak_bytes", "device_memory_bytes",
    "kv_bytes_per_token", "plan_kv_cache", "tree_nbytes",
]
