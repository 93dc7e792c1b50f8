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
from jaxinfer.parallel.transfer import sampling_inputs_size, split_step_specs
from jaxinfer.worker.programs import SAMPLE_VARIANTS
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
    each variant the engine compiles (which is largest depends on XLA's choices); both as the
    engine runs them, on the packed inputs (step_programs.packed_forward, packed_sample). Costs four
    compilations (the forward, three small samplers), unless `cache` holds the figure from an
    earlier start (same key parts as the executables: shapes, shardings, code, compiler)."""
    from jaxinfer.worker.kv import activation_peak_bytes
    buckets = Buckets.make(max_num_seqs, max_num_batched_tokens)
    t, s = buckets.mixed_shape(buckets.token_buckets[-1])
    groups = kv_groups or KVCacheGroups.for_model(cfg, hybrid=False)
    max_blocks = groups.table_width(max_model_len, block_size, kv_dtype, kernels.table_columns)
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
    forward, sampler = programs.jitted["packed forward"], programs.jitted["packed sample"]
    tail = max(map(sampling_inputs_size, batches.values()))  # as ModelRunner.sampling_tail
    packed = {v: split_step_specs(b, plan, tail) for v, b in batches.items()}
    buf, _, packing, _ = packed[MASKED_SAMPLER]
    logits = jax.ShapeDtypeStruct((s, cfg.vocab_size), jnp.float32)
    peak = (activation_peak_bytes(forward.lower(params, kv, last, buf,
                                                packing=packing.model).compile())
            + max(activation_peak_bytes(sampler.lower(logits, last, tail_spec, apart,
                                                      packing=packing.sample,
                                                      variant=v).compile())
                  for v, (_, apart, packing, tail_spec) in packed.items()))
    if key:
        cache.store_figure(key, peak)
    return peak


def compiled_steps_peak_bytes(runner) -> tuple[int, int]:
    """(peak, executables): the measured counterpart of `step_activation_bytes` over every step
    executable the runner holds now (the buckets compiled so far, at the real pool size): the
    largest forward or decode loop plus the largest sampler, as a step runs one after the other."""
    from jaxinfer.worker.kv import activation_peak_bytes
    # Copies first: the background compiler adds to these tables meanwhile.
    compiled = runner.programs.compiled
    steps = [*compiled["packed forward"].copy().values(), *compiled["forward"].copy().values(),
             *compiled["decode loop"].copy().values()]
    samplers = [*compiled["packed sample"].copy().values(), *compiled["sample"].copy().values()]
    peak = (max(map(activation_peak_bytes, steps), default=0)
            + max(map(activation_peak_bytes, samplers), default=0))
    return peak, len(steps) + len(samplers)
