"""How many KV-cache blocks an engine gets: --num-blocks, else the memory planner's figure."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxinfer.core.kv_cache.cache_config import resolve_kv_cache_dtype
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups
from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.config import ModelConfig
from jaxinfer.parallel.sharding import ShardingPlan, per_device_bytes
from jaxinfer.worker.executable_cache import ExecutableCache
from jaxinfer.worker.kv import plan_kv_cache
from jaxinfer.engine.kernels import engine_kernels
from jaxinfer.worker.kv.kv_scales import kv_cache_kernels
from jaxinfer.worker.kv.planner import largest_free_block_bytes
from jaxinfer.worker.activation_bytes import step_activation_bytes

log = logging.getLogger(__name__)


def params_dtype_name(params) -> str:
    """The weights' dtype ("bfloat16", ...): the model dtype the KV cache follows by default."""
    return jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name


def plan_num_blocks(cfg: ModelConfig, args: EngineArgs, params,
                    plan: ShardingPlan | None = None) -> int:
    """--num-blocks, else the memory planner, per device (device memory x utilization - this
    device's weight shards - the largest step's activations, over the bytes a block takes on
    one device); a CPU reports no memory size: there, enough blocks for max_num_seqs
    full-length sequences, at most 4096."""
    max_len = args.max_model_len or cfg.max_position_embeddings
    cache = args.cache_config()
    if cache.num_blocks is not None:
        return cache.num_blocks
    if jax.devices()[0].platform == "cpu":
        per_seq = KVCacheGroups.for_model(cfg, args.hybrid_kv_cache).blocks_for_sequence(
            max_len, args.max_num_batched_tokens, args.block_size)
        blocks = max(min(4096, args.max_num_seqs * per_seq), per_seq)
        log.info("KV cache: %d blocks (CPU default; pass --num-blocks to change)", blocks)
        return blocks
    model_dtype = params_dtype_name(params)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype)
    activations = step_activation_bytes(
        cfg, params, kv_cache_kernels(engine_kernels(args), kv_dtype, cfg),
        kv_dtype=kv_dtype,
        block_size=args.block_size, max_model_len=max_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, plan=plan,
        kv_groups=KVCacheGroups.for_model(cfg, args.hybrid_kv_cache),
        cache=ExecutableCache.under(args.compilation_cache_dir))
    # A block holds kv_heads_per_device heads on each device.
    device_cfg = dataclasses.replace(cfg, num_kv_heads=plan.kv_heads_per_device) if plan else cfg
    devices = plan.mesh.devices.flat if plan else jax.local_devices()[:1]
    kv_plan = plan_kv_cache(device_cfg, cache, weight_bytes=per_device_bytes(params),
                            activation_bytes=activations, model_dtype=model_dtype,
                            contiguous_bytes=largest_free_block_bytes(
                                [d for d in devices if d.process_index == jax.process_index()]))
    log.info(kv_plan.describe())
    return kv_plan.num_blocks


def with_hybrid_kv_decided(cfg: ModelConfig, args: EngineArgs) -> EngineArgs:
    """`args` with --hybrid-kv-cache off when a draft model or an EAGLE-3 head keeps its KV in the
    target's first group and every group is windowed (a Mistral with `sliding_window`): those
    blocks would leave with the window. The windows still apply in the kernels."""
    spec = args.spec_config()
    if not args.hybrid_kv_cache or spec is None or spec.method == "ngram":
        return args
    if KVCacheGroups.for_model(cfg).specs[0].keeps_every_block:
        return args
    log.info("KV groups off (--no-hybrid-kv-cache): the %s drafter keeps its KV in the target's "
             "blocks and no target layer has full attention", spec.method)
    return dataclasses.replace(args, hybrid_kv_cache=False)
