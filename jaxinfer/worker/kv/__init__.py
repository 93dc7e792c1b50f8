"""The KV cache on the device: ``device_cache`` (``allocate_kv_cache``, ``copy_blocks``),
``planner`` (how many blocks fit beside the weights and activations), ``kv_scales`` (fp8 cache
scales: checkpoint tensors, or calibration that runs the model). The host's bookkeeping of the same
blocks is ``jaxinfer/core/kv_cache``."""

from jaxinfer.worker.kv.device_cache import allocate_kv_cache, copy_blocks, kv_block_shapes
from jaxinfer.worker.kv.planner import (KVCachePlan, MemoryPlanError, activation_peak_bytes,
                                        device_memory_bytes, kv_bytes_per_token, plan_kv_cache,
                                        tree_nbytes)

__all__ = [
    "allocate_kv_cache", "copy_blocks", "kv_block_shapes", "KVCachePlan", "MemoryPlanError",
    "activation_peak_bytes",
    "device_memory_bytes", "kv_bytes_per_token", "plan_kv_cache", "tree_nbytes",
]
