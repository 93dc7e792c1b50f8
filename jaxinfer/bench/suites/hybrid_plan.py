"""The memory-plan section of jaxinfer/bench/suites/hybrid.py: how many 128k-token sequences the
engine's pool holds on a device, for a hybrid (its state-space layers keep one state per
sequence, whatever its length) beside Llama-3-8B (every layer's K and V for every token).

All from the model's config and the engine's own planners, no weights made: the pre-load figures
(engine/memory_preflight.py: the param tree's bytes with the quantization, the activation floor,
the compile scratch) size the pool as the engine's planner does (worker/kv/planner.py
`plan_kv_cache`, at the default --gpu-memory-utilization and --max-num-batched-tokens), and one
sequence of 131,072 tokens takes `KVCacheGroups.blocks_for_sequence` blocks (its attention pages,
plus each state group's pages). The device's memory is what the engine sees
(`device_memory_bytes`: JAX's allocator limit, or $JAXINFER_DEVICE_MEMORY), so a CPU computes the
figures for any device size.
"""

from __future__ import annotations

import dataclasses

SEQ_128K = 131072


def max_concurrent(config: dict, seq_len: int = SEQ_128K, quantization: str | None = None) -> dict:
    """The pool and one `seq_len` sequence of the model of `config` (a config.json dict) on this
    device: {"max_concurrent", "pool_blocks", "sequence_blocks", "pool_gib", "sequence_gib",
    "weight_gib", "device_gib"}."""
    import jax.numpy as jnp

    from jaxinfer.core.kv_cache import KVCacheGroups
    from jaxinfer.core.kv_cache.cache_config import resolve_kv_cache_dtype
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.kv_blocks import with_hybrid_kv_decided
    from jaxinfer.engine.memory_preflight import preflight
    from jaxinfer.model.config import config_from_dict
    from jaxinfer.model.transformer import param_shapes
    from jaxinfer.worker.kv import plan_kv_cache
    from jaxinfer.worker.kv.planner import GIB, device_memory_bytes

    cfg = dataclasses.replace(config_from_dict(config), quantization=quantization)
    args = EngineArgs(model="(config only)", max_model_len=seq_len, quantization=quantization)
    args = with_hybrid_kv_decided(cfg, args)
    dtype = jnp.bfloat16
    figures = preflight(cfg, args, param_shapes(cfg, dtype), None, dtype,
                        device_bytes=device_memory_bytes(args.gpu_memory_utilization))
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, "bfloat16")
    pool = plan_kv_cache(cfg, args.cache_config(), weight_bytes=figures.weight_bytes,
                         activation_bytes=figures.activation_floor_bytes,
                         device_bytes=figures.device_bytes, model_dtype="bfloat16",
                         compile_scratch_bytes=figures.compile_scratch_bytes)
    groups = KVCacheGroups.for_model(cfg, args.hybrid_kv_cache)
    per_seq = groups.blocks_for_sequence(seq_len, args.max_num_batched_tokens, args.block_size,
                                         kv_dtype)
    return {"max_concurrent": pool.num_blocks // per_seq, "pool_blocks": pool.num_blocks,
            "sequence_blocks": per_seq,
            "pool_gib": round(pool.kv_bytes / GIB, 3),
            "sequence_gib": round(per_seq * pool.bytes_per_block / GIB, 3),
            "weight_gib": round(figures.weight_bytes / GIB, 3),
            "device_gib": round(figures.device_bytes / GIB, 3),
            "gpu_memory_utilization": args.gpu_memory_utilization}


def plan_section(models: dict) -> dict:
    """`max_concurrent` at 128k for each of `models` ({name: (config, quantization)}), flat:
    `<name>_max_concurrent_128k` and the figures behind it, `<name>_plan_*`; a model whose
    weights leave no room for the pool gets 0 and its planner's reason."""
    from jaxinfer.worker.kv import MemoryPlanError

    out: dict = {}
    for name, (config, quantization) in models.items():
        try:
            plan = max_concurrent(config, quantization=quantization)
        except MemoryPlanError as e:
            out[f"{name}_max_concurrent_128k"] = 0
            out[f"{name}_plan_refused"] = str(e)[:500]
            continue
        out[f"{name}_max_concurrent_128k"] = plan.pop("max_concurrent")
        out.update({f"{name}_plan_{k}": v for k, v in plan.items()})
    return out
