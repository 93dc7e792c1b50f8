"""How many KV-cache blocks an engine gets: --num-blocks, else the memory planner's figure."""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp

from jaxinfer.core.kv_cache.cache_config import resolve_kv_cache_dtype
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups
from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.config import ModelConfig
from jaxinfer.parallel.sharding import ShardingPlan, per_device_bytes
from jaxinfer.worker.executable_cache import ExecutableCache
from jaxinfer.engine.kernels import engine_kernels
from jaxinfer.worker.bucket_compiler import compile_workers
from jaxinfer.worker.kv import KVCachePlan, plan_kv_cache
from jaxinfer.worker.kv.compile_scratch import plan_compiles
from jaxinfer.worker.kv.kv_scales import kv_cache_kernels
from jaxinfer.worker.kv.planner import (GIB, device_memory_bytes, device_memory_override,
                                        largest_free_block_bytes)
from jaxinfer.worker.activation_bytes import compiled_steps_peak_bytes, step_activation_bytes

log = logging.getLogger(__name__)


def params_dtype_name(params) -> str:
    """The weights' dtype ("bfloat16", ...): the model dtype the KV cache follows by default."""
    return jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name


def plan_kv_blocks(cfg: ModelConfig, args: EngineArgs, params,
                   plan: ShardingPlan | None = None) -> KVCachePlan:
    """--num-blocks, else the memory planner, per device (device memory x utilization - this
    device's weight shards - the largest step's measured activations - the compile scratch, over
    the bytes a block takes on one device); a CPU reports no memory size (unless
    $JAXINFER_DEVICE_MEMORY stands in for it): there, enough blocks for max_num_seqs full-length
    sequences, at most 4096."""
    max_len = args.max_model_len or cfg.max_position_embeddings
    cache = args.cache_config()
    model_dtype = params_dtype_name(params)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype)
    groups = KVCacheGroups.for_model(cfg, args.hybrid_kv_cache)
    platform = jax.devices()[0].platform
    # A block holds kv_heads_per_device heads on each device.
    device_cfg = dataclasses.replace(cfg, num_kv_heads=plan.kv_heads_per_device) if plan else cfg
    if cache.num_blocks is None and platform == "cpu" and device_memory_override() is None:
        per_seq = groups.blocks_for_sequence(max_len, args.max_num_batched_tokens, args.block_size,
                                             kv_dtype)
        blocks = max(min(4096, args.max_num_seqs * per_seq), per_seq)
        log.info("KV cache: %d blocks (CPU default; pass --num-blocks to change)", blocks)
        cache = dataclasses.replace(cache, num_blocks=blocks)
    if cache.num_blocks is not None:
        return plan_kv_cache(device_cfg, cache, weight_bytes=0, model_dtype=model_dtype)
    activations = step_activation_bytes(
        cfg, params, kv_cache_kernels(engine_kernels(args.create_engine_config()), kv_dtype, cfg),
        kv_dtype=kv_dtype,
        block_size=args.block_size, max_model_len=max_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, plan=plan, kv_groups=groups,
        cache=ExecutableCache.under(args.compilation_cache_dir))
    devices = plan.mesh.devices.flat if plan else jax.local_devices()[:1]
    device_bytes = device_memory_bytes(cache.gpu_memory_utilization)
    compiles = plan_compiles(
        params, vocab_size=cfg.vocab_size, max_rows=args.max_num_batched_tokens,
        max_logit_rows=min(args.max_num_seqs, args.max_num_batched_tokens),
        device_bytes=device_bytes, max_workers=compile_workers(), platform=platform)
    kv_plan = plan_kv_cache(device_cfg, cache, weight_bytes=per_device_bytes(params),
                            activation_bytes=activations, model_dtype=model_dtype,
                            device_bytes=device_bytes,
                            compile_scratch_bytes=compiles.scratch_bytes,
                            compile_workers=compiles.workers,
                            contiguous_bytes=largest_free_block_bytes(
                                [d for d in devices if d.process_index == jax.process_index()]))
    log.info(kv_plan.describe())
    return kv_plan


def with_compiled_peak(memory_plan: dict, runner) -> dict:
    """The engine's memory plan with the activations its compiled steps measure (the buckets
    compiled so far, at the real pool size) beside the planned figure, logged; a warning when
    they exceed it."""
    peak, count = compiled_steps_peak_bytes(runner)
    memory_plan = {**memory_plan, "compiled_peak_bytes": peak, "compiled_executables": count}
    log.info("memory plan: %s", json.dumps(memory_plan))
    planned = (memory_plan.get("kv") or {}).get("activation_bytes")
    if planned is not None and peak > planned:
        log.warning("the compiled steps need %.2f GiB of activations, more than the %.2f GiB the "
                    "KV cache was planned beside: lower --gpu-memory-utilization if the engine "
                    "runs out of memory", peak / GIB, planned / GIB)
    return memory_plan


def with_hybrid_kv_decided(cfg: ModelConfig, args: EngineArgs,
                           role: str | None = None) -> EngineArgs:
    """`args` with --hybrid-kv-cache off (one KV group, every layer keeping every block; the
    windows still apply in the kernels) where a feature needs whole prefix blocks, logged:
    - the host tier (--kv-offload): a host block is one prefix block of every layer, and a
      windowed group's block of an old prefix may be gone;
    - a disaggregated engine (`role`): the hand-over carries one attention group's blocks per
      request (and a state-space layer's group's state pages, which stays apart);
    - a draft model or an EAGLE-3 head over a target whose every group is windowed (a Mistral
      with `sliding_window`): the drafter keeps its KV in the first group's blocks, which would
      leave with the window."""
    if not args.hybrid_kv_cache:
        return args
    groups = KVCacheGroups.for_model(cfg)
    spec = args.spec_config()
    if args.kv_offload and groups.frees_token_blocks:
        why = "the host tier (--kv-offload) keeps whole prefix blocks"
    elif role is not None and groups.num_groups > 1:
        why = "the disaggregated hand-over carries one attention group's blocks per request"
    elif (spec is not None and spec.method != "ngram"
          and not groups.specs[0].keeps_every_block):
        why = (f"the {spec.method} drafter keeps its KV in the target's blocks and no target "
               f"layer has full attention")
    else:
        return args
    log.info("KV groups off (--no-hybrid-kv-cache): %s", why)
    return dataclasses.replace(args, hybrid_kv_cache=False)
