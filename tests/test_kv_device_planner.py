"""Device-side block copy, cache flags and the memory planner, against hand-computed figures."""

import argparse
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import ModelConfig, RopeConfig
from jaxinfer.errors import ConfigError
from jaxinfer.core.kv_cache import CacheConfig, KVCacheManager, add_cache_arguments
from jaxinfer.worker.kv import (MemoryPlanError, activation_peak_bytes, allocate_kv_cache, copy_blocks,
                                device_memory_bytes, kv_bytes_per_token, plan_kv_cache, tree_nbytes)
from jaxinfer.worker.kv.planner import CONTIGUOUS_SLACK, largest_free_block_bytes

# Llama-3.1-8B's attention shape: 32 layers, 8 KV heads, head_dim 128.
LLAMA8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, rms_norm_eps=1e-5, rope=RopeConfig(), max_position_embeddings=8192)
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
                   intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                   rms_norm_eps=1e-5, rope=RopeConfig(), max_position_embeddings=64)


def test_copy_blocks_copies_every_layer_reads_before_writes_and_skips_padding():
    rng = np.random.default_rng(0)
    cache = allocate_kv_cache(TINY, num_blocks=6, block_size=4, dtype=jnp.float32)
    cache = tuple((jnp.asarray(rng.normal(size=k.shape), jnp.float32),
                   jnp.asarray(rng.normal(size=v.shape), jnp.float32)) for k, v in cache)
    before = [(np.asarray(k), np.asarray(v)) for k, v in cache]
    # 1 -> 4, 4 -> 5 (reads 4's old content), then a padding entry.
    src = jnp.array([1, 4, 0], jnp.int32)
    dst = jnp.array([4, 5, -1], jnp.int32)
    out = copy_blocks(cache, src, dst)
    for (k0, v0), (k1, v1) in zip(before, out):
        for old, new in ((k0, k1), (v0, v1)):
            expect = old.copy()
            expect[:, [4, 5]] = old[:, [1, 4]]
            np.testing.assert_array_equal(np.asarray(new), expect)


def test_manager_copies_drive_copy_blocks():
    """End to end: fork, child appends (copy-on-write), the runner applies the copy."""
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.allocate_slots("p", 2)
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 1)
    (src, dst), = mgr.take_pending_copies()
    cache = allocate_kv_cache(TINY, num_blocks=4, block_size=4, dtype=jnp.float32)
    cache = tuple((k.at[:, src].set(1.0), v.at[:, src].set(2.0)) for k, v in cache)
    cache = copy_blocks(cache, jnp.array([src]), jnp.array([dst]))
    k, v = cache[1]
    assert float(k[:, dst].min()) == 1.0 and float(v[:, dst].max()) == 2.0


def test_kv_bytes_per_token_is_the_seed_formula():
    assert kv_bytes_per_token(32, 8, 128, 2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(80, 8, 128, 1) == 163840  # 70B-class with an fp8 cache


def test_plan_from_budget_by_hand():
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9)
    device = 140 * 2**30
    weights, acts = 16_060_522_496, 3 * 2**30
    plan = plan_kv_cache(LLAMA8B, cache, weight_bytes=weights, activation_bytes=acts,
                         device_bytes=device)
    block = 16 * 131072  # 2 MiB
    assert plan.bytes_per_block == block
    # 126 GiB = 64512 blocks, minus 7658.25 blocks of weights and 1536 of activations
    assert plan.num_blocks == (int(0.9 * device) - weights - acts) // block == 55317
    assert plan.max_tokens == 55317 * 16
    assert "55317 blocks" in plan.describe() and "weights" in plan.describe()


def test_a_fragmented_device_bounds_the_cache_by_its_largest_free_region():
    """Each K/V array is one allocation: free memory in holes smaller than one cannot hold it
    (weights quantized on load leave such holes), so the plan stays within the largest free
    region, less the activations and the slack; a region larger than the budget changes nothing."""
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9)
    kw = dict(weight_bytes=16 * 2**30, activation_bytes=2**30, device_bytes=140 * 2**30)
    free = plan_kv_cache(LLAMA8B, cache, **kw)
    region = 60 * 2**30
    capped = plan_kv_cache(LLAMA8B, cache, **kw, contiguous_bytes=region)
    block = 16 * 131072
    assert capped.num_blocks == (region - 2**30 - CONTIGUOUS_SLACK) // block < free.num_blocks
    assert capped.contiguous_bytes == region and "largest free region" in capped.describe()
    roomy = plan_kv_cache(LLAMA8B, cache, **kw, contiguous_bytes=200 * 2**30)
    assert roomy.num_blocks == free.num_blocks and roomy.contiguous_bytes is None
    assert largest_free_block_bytes(jax.devices()[:1]) is None  # the CPU reports no such figure


def test_fp8_cache_fits_twice_the_blocks():
    kw = dict(weight_bytes=10 * 2**30, device_bytes=80 * 2**30)
    bf16 = plan_kv_cache(LLAMA8B, CacheConfig(kv_cache_dtype="bfloat16"), **kw)
    fp8 = plan_kv_cache(LLAMA8B, CacheConfig(kv_cache_dtype="fp8"), **kw)
    assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
    assert fp8.num_blocks in (2 * bf16.num_blocks, 2 * bf16.num_blocks + 1)


def test_num_blocks_overrides_the_planner_without_a_device_query():
    plan = plan_kv_cache(LLAMA8B, CacheConfig(num_blocks=123), weight_bytes=10**15)
    assert plan.num_blocks == 123 and plan.device_bytes is None
    assert plan.describe().endswith("(--num-blocks)")


def test_no_room_names_the_flags():
    with pytest.raises(MemoryPlanError, match="--gpu-memory-utilization"):
        plan_kv_cache(LLAMA8B, CacheConfig(), weight_bytes=20 * 2**30, device_bytes=16 * 2**30)


def test_cpu_has_no_device_memory_figure():
    assert jax.devices()[0].platform == "cpu"
    with pytest.raises(MemoryPlanError, match="--num-blocks"):
        device_memory_bytes()


def test_activation_peak_counts_temp_code_and_unaliased_outputs():
    stats = types.SimpleNamespace(temp_size_in_bytes=1000, generated_code_size_in_bytes=10,
                                  output_size_in_bytes=5000, alias_size_in_bytes=4800)
    assert activation_peak_bytes(types.SimpleNamespace(memory_analysis=lambda: stats)) == 1210
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones((256,), jnp.float32)).compile()
    assert activation_peak_bytes(compiled) >= 1024  # a fresh 1 KiB output


def test_tree_nbytes():
    assert tree_nbytes({"a": jnp.ones((3, 4), jnp.bfloat16), "b": [jnp.ones(5, jnp.float32)]}) == 44


def test_cache_flags_round_trip_and_errors_name_the_flag():
    p = argparse.ArgumentParser()
    add_cache_arguments(p)
    cfg = CacheConfig.from_args(p.parse_args(["--block-size", "32", "--num-blocks", "100",
                                              "--no-enable-prefix-caching"]))
    assert cfg == CacheConfig(block_size=32, num_blocks=100, enable_prefix_caching=False)
    assert CacheConfig.from_args(p.parse_args([])) == CacheConfig()
    for kwargs, flag in ((dict(block_size=12), "--block-size"),
                         (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
                         (dict(num_blocks=0), "--num-blocks"),
                         (dict(kv_cache_dtype="int3"), "--kv-cache-dtype")):
        with pytest.raises(ConfigError, match=flag):
            CacheConfig(**kwargs)
