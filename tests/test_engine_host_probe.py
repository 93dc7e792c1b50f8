"""bench/profile/engine_host_probe.py on the CPU: the steady batch-1 decode steps of an engine on fused
weights, bf16 and FP8 (issue 26), compile, trace and transfer nothing implicitly and dispatch on
jit's fast path in the lone-sequence bucket; and the probe does see a step that re-traces or
copies host data implicitly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.fused_projections import fuse_projections
from jaxinfer.model.quant import loading
from jaxinfer.model.transformer import param_shapes
from jaxinfer.model.weights import _flat_paths, _set
from test_engine_support import BLOCK, MAX_LEN, NUM_BLOCKS, prompt_ids, tiny_model, tiny_tokenizer
from jaxinfer.bench.profile.engine_host_probe import probe_host

STEPS = 12


def fused_engine(quantization: str | None, quant_impl: str = "auto") -> LLMEngine:
    """The tiny model as one GPU serves it (fuse_for_serving): fused, FP8 as `--quantization fp8`
    quantizes it on load, its matmuls `quant_impl`'s (`--quant-impl`)."""
    cfg, params = tiny_model()
    if quantization:
        cfg = dataclasses.replace(cfg, quantization=quantization)
        flat = {k: jnp.array(v) for k, v in _flat_paths(params).items()}  # the loader deletes
        params = {}
        for key, leaf in loading.quantize_unquantized(
                flat, _flat_paths(param_shapes(cfg, jnp.float32)), quantization, {}).items():
            _set(params, key, leaf)
    args = EngineArgs(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                      max_num_seqs=8, max_num_batched_tokens=32, compilation_cache_dir=None,
                      warmup=False, dtype="float32", quant_impl=quant_impl)
    return LLMEngine(cfg, fuse_projections(params), tiny_tokenizer(), args, num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_steady_batch1_steps_compile_nothing_and_sync_nothing(quantization):
    engine = fused_engine(quantization, quant_impl="dequant")  # what the GPU runs at batch 1
    probe = probe_host(engine, [prompt_ids(5, 9)], steps=STEPS, replays=4)
    assert probe["steps"] == STEPS and probe["implicit_transfer"] is None
    assert probe["compiles"] == probe["traces"] == probe["python_dispatches"] == 0
    assert probe["forward_bucket"] == [1, 1, 1]
    assert probe["dispatch_ms"] > 0 and probe["host"]["launch"] > 0
    assert not engine.has_unfinished_requests()


def test_the_probe_sees_a_retrace_and_an_implicit_copy(monkeypatch):
    engine = fused_engine("fp8")
    runner = engine.runner
    sample, x = runner.programs.jitted["packed sample"], jax.device_put(np.ones(1, np.float32))

    def retracing(*args, **kwargs):
        jax.jit(lambda v: v + 1)(x)  # a new function per call: traced and compiled every step
        return sample(*args, **kwargs)
    monkeypatch.setitem(runner.programs.jitted, "packed sample", retracing)
    probe = probe_host(engine, [prompt_ids(6, 9)], steps=STEPS, replays=1)
    assert probe["implicit_transfer"] is None
    assert probe["traces"] >= STEPS and probe["compiles"] >= STEPS
    assert probe["python_dispatches"] >= STEPS

    def copying(*args, **kwargs):
        jax.jit(jnp.negative)(np.ones(1, np.float32))  # numpy into a jit: an implicit copy
        return sample(*args, **kwargs)
    monkeypatch.setitem(runner.programs.jitted, "packed sample", copying)
    probe = probe_host(engine, [prompt_ids(7, 9)], steps=STEPS, replays=1)
    assert "host-to-device" in probe["implicit_transfer"]


def test_launch_costs_split_the_launch_of_each_decode_bucket():
    from jaxinfer.bench.profile.profile_host_step import launch_costs
    engine = fused_engine(None)
    sizes = tuple(engine.runner.buckets.decode_buckets[:2])
    costs = launch_costs(engine, sizes, reps=3)
    assert sorted(costs) == sorted(f"decode{s}" for s in sizes)
    for parts in costs.values():
        assert set(parts) == {"launch_ms", "pack_ms", "place_ms", "dispatch_ms"}
        assert all(ms > 0 for ms in parts.values())
    assert not engine.has_unfinished_requests()


def test_command_buffer_variants_become_per_variant_keys_and_skip_errors():
    from jaxinfer.bench.profile.command_buffers import metrics_of, table
    probe = {"step_ms": 5.5, "host": {}, "host_ms": 3.0, "launch_cpu_ms": 2.6,
             "dispatch_ms": 2.9, "dispatch_cpu_ms": 2.9, "compiles": 0}
    results = {"off": {"bs1_tpot_ms": 7.7, "bs1": probe, "c64": dict(probe, step_ms=11.0),
                       "launch": {"decode8": {"pack_ms": 0.1, "dispatch_ms": 6.5}}},
               "min1": {"error": "timed out after 150 s"}}
    m = metrics_of(results)
    assert m["off_bs1_tpot_ms"] == 7.7 and m["off_c64_step_ms"] == 11.0
    assert m["off_bs1_dispatch_cpu_ms"] == 2.9 and m["off_decode8_dispatch_ms"] == 6.5
    assert not any(k.startswith("min1") for k in m)
    assert "timed out" in table(results).splitlines()[-1]
