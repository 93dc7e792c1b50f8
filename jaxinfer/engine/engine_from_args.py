"""Building an engine from its flags (`LLMEngine.from_engine_args`): the model's config, the
replica's mesh, the tokenizer, a check that the model can fit before its weights load, the weights
and a draft model, then the KV pool's size from the memory left, each a timed start-up phase
(startup.py). Warm-up is the caller's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.core.kv_cache import KVCacheGroups
from jaxinfer.core.kv_cache.cache_config import resolve_kv_cache_dtype
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.kv_blocks import params_dtype_name, plan_kv_blocks, with_hybrid_kv_decided
from jaxinfer.engine.lora import with_lora_stacks
from jaxinfer.engine.lora_args import with_lora_impl_decided
from jaxinfer.engine.memory_preflight import refuse_if_it_cannot_fit
from jaxinfer.engine.metrics import EngineMetrics
from jaxinfer.engine.startup import StartupTimes
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import load_config
from jaxinfer.model.quant_scheme import resolve_quantization
from jaxinfer.model.tokenizer import load_tokenizer
from jaxinfer.model.transformer import param_shapes
from jaxinfer.parallel.distributed import fewest_across_processes
from jaxinfer.parallel.sharding import ShardingPlan, build_mesh, validate_parallel_sizes
from jaxinfer.spec_decode.draft import draft_for_engine, share_blocks

_JNP_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def build_engine(cls, args: EngineArgs, metrics: EngineMetrics | None = None,
                 mesh: Mesh | None = None, **parts):
    """An engine of class `cls` (LLMEngine) with its weights loaded and its KV pool planned, not
    warmed up; see `LLMEngine.from_engine_args` for `mesh` and `parts`."""
    from jaxinfer.model.fused_projections import fuse_for_serving
    from jaxinfer.model.kernel_table import current_platform
    from jaxinfer.model.weights import load_params
    from jaxinfer.worker.kv.planner import claim_allocator_share
    claim_allocator_share(args.gpu_memory_utilization)  # before anything starts JAX
    startup = StartupTimes()
    # --compilation-cache-dir holds the executable cache (the runner's), not jax's persistent
    # compilation cache: an executable jax loaded from its own cache serializes again without
    # its kernels' code (XLA CPU: "Function ... not found" when the stored copy runs).
    model_dir = args.model_path
    with startup.phase("config"):
        cfg = load_config(model_dir)
        cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
            args.quantization, cfg.quantization, args.load_format))
        args = with_hybrid_kv_decided(cfg, args, parts.get("role"))
        args = with_lora_impl_decided(args)
    if mesh is None:
        if args.data_parallel_size > 1:
            raise ConfigError("--data-parallel-size > 1 needs the data-parallel front end: "
                              "build the engine with jaxinfer.frontends.factory.create_engine")
        validate_parallel_sizes(cfg, args.tensor_parallel_size, args.data_parallel_size,
                                jax.device_count(), args.expert_layout)
        mesh = build_mesh(args.tensor_parallel_size)
    plan = ShardingPlan(mesh, cfg, args.expert_layout)
    with startup.phase("tokenizer"):
        tokenizer = load_tokenizer(args.model_path, args.tokenizer, args.chat_template)
    dtype = _JNP_DTYPES.get(cfg.dtype if args.dtype == "auto" else args.dtype, jnp.bfloat16)
    shapes = param_shapes(cfg, dtype)
    with startup.phase("memory_preflight"):  # what cannot fit is said before the weights load
        preflight = refuse_if_it_cannot_fit(cfg, args, shapes, plan, dtype)
    with startup.phase("weights"):
        params = jax.block_until_ready(fuse_for_serving(
            load_params(model_dir, cfg, dtype, args.load_format, seed=args.seed,
                        shardings=plan.params(shapes)), current_platform(), cfg))
        draft = draft_for_engine(args, cfg, tokenizer, dtype, plan)
    with startup.phase("kv_plan_and_alloc"):
        # (planned with the weights)
        params = with_lora_stacks(cfg, params, args.create_engine_config(), plan)
        kv_plan = plan_kv_blocks(cfg, args, params, plan)
        num_blocks = kv_plan.num_blocks
        if draft is not None and args.num_blocks is None:
            kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, params_dtype_name(params))
            num_blocks = share_blocks(num_blocks, draft, cfg, args.block_size, kv_dtype, plan,
                                      KVCacheGroups.for_model(cfg, args.hybrid_kv_cache).num_slots)
        num_blocks = fewest_across_processes(num_blocks)
        engine = cls(cfg, params, tokenizer, args, num_blocks=num_blocks, metrics=metrics,
                     plan=plan, draft=draft, **parts)
        jax.block_until_ready(engine.runner.kv_cache)
    engine.startup = startup
    engine.memory_plan = {"preflight": preflight and preflight.as_dict(),
                          "kv": kv_plan.as_dict(), "num_blocks": num_blocks}
    engine.owns_weights = True  # loaded here: an update may free them
    return engine
