"""The activation figure the memory planner subtracts (worker/kv/planner.py): what the largest
step bucket needs beyond its inputs, from compiling that step against a two-block cache; and the
same figure over the executables compiled at the real pool size, to check the plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.core.kv_cache import KVCacheGroups
from jaxinfer.model.config import ModelConfig
from jaxinfer.parallel.kernels import shard_kernels
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.worker.bucket_compiler import SAMPLE_VARIANTS, model_inputs
from jaxinfer.worker.buckets import Buckets
from jaxinfer.worker.executable_cache import ExecutableCache, step_key
from jaxinfer.worker.kv import kv_block_shapes
from jaxinfer.worker.runner import step_programs
from jaxinfer.worker.sampler import MASKED_SAMPLER
from jaxinfer.worker.step_inputs import SamplingTable, build_step_batch
from jaxinfer.model.kernel_table import KernelTable


def step_activation_bytes(cfg: ModelConfig, params, kernels: KernelTable, *, kv_dtype,
                          block_size: int, max_model_len: int, max_num_seqs: int,
                          max_num_batched_tokens: int, plan: ShardingPlan | None = None,
                          cache: ExecutableCache | None = None,
                          kv_groups: KVCacheGroups | None = None, probe_blocks: int = 2) -> int:
    """Device memory the largest step bucket needs beyond its inputs (for the memory planner; per
    device under tensor parallelism), from compiling that step against a `probe_blocks`-block
    cache of the same layout: the pool's size is a static shape of the executables, so the real
    ones cannot be compiled before it is planned, but the cache is donated to the step and
    aliased to its output, so a step's activations do not depend on the number of blocks
    (tests/test_memory_plan.py checks that on the CPU) -- from two blocks on: XLA simplifies the
    page gathers of a one-block cache, whose temp comes out smaller. The sampler is measured in
    each variant the engine compiles (which is largest depends on XLA's choices); their sum
    bounds the fused step's (step_programs.fused_step), which frees the forward's activations
    before it samples. Costs four
    compilations (the forward, three small samplers), unless `cache` holds the figure from an
    earlier start (same key parts as the executables: shapes, shardings, code, compiler)."""
    from jaxinfer.worker.kv import activation_peak_bytes
    buckets = Buckets.make(max_num_seqs, max_num_batched_tokens)
    t, s = buckets.mixed_shape(buckets.token_buckets[-1])
    groups = kv_groups or KVCacheGroups.for_model(cfg, hybrid=False)
    max_blocks = groups.table_width(max_model_len, block_size, kv_dtype)
    batches = {v: build_step_batch([], 0, t, s, SamplingTable(max_num_seqs, cfg.vocab_size),
                                   block_size, max_blocks, max_model_len, v,
                                   kv_layout=groups.kv_layout) for v in SAMPLE_VARIANTS}
    batch = batches[MASKED_SAMPLER]
    heads = plan.stored_kv_heads if plan else cfg.num_kv_heads
    probe_pages = tuple(jax.ShapeDtypeStruct(shape, kv_dtype, sharding=plan and plan.kv_cache)
                      for shape in kv_block_shapes(cfg, heads, probe_blocks, block_size))
    kv = tuple(probe_pages for _ in range(groups.num_slots))
    last = jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32, sharding=plan and plan.replicated)
    kernels = shard_kernels(kernels, plan)
    key = cache and step_key("activation bytes", (cfg, kernels, block_size),
                             (params, kv, last, batch))
    cached = key and cache.load_figure(key)
    if cached is not None:
        return cached
    programs = step_programs(cfg, kernels, block_size, plan)
    forward_step, sample_step = programs.jitted["forward"], programs.jitted["sample"]
    logits = jax.ShapeDtypeStruct((s, cfg.vocab_size), jnp.float32)
    peak = (activation_peak_bytes(forward_step.lower(params, kv, last,
                                                     model_inputs(batch)).compile())
            + max(activation_peak_bytes(sample_step.lower(logits, last, b.sampling, b.emit_slot,
                                                          variant=v).compile())
                  for v, b in batches.items()))
    if key:
        cache.store_figure(key, peak)
    return peak


def compiled_steps_peak_bytes(runner) -> tuple[int, int]:
    """(peak, executables): the measured counterpart of `step_activation_bytes` over every step
    executable the runner holds now (the buckets compiled so far, at the real pool size): the
    largest step (forward and sampler in one) or decode loop, or the largest forward plus the
    largest sampler where they run one after the other (an EAGLE-3 head's steps)."""
    from jaxinfer.worker.kv import activation_peak_bytes
    # Copies first: the background compiler adds to these tables meanwhile.
    compiled = runner.programs.compiled
    whole = [*compiled["step"].copy().values(), *compiled["decode loop"].copy().values()]
    forwards = list(compiled["forward"].copy().values())
    samplers = list(compiled["sample"].copy().values())
    peak = max(max(map(activation_peak_bytes, whole), default=0),
               max(map(activation_peak_bytes, forwards), default=0)
               + max(map(activation_peak_bytes, samplers), default=0))
    return peak, len(whole) + len(forwards) + len(samplers)
