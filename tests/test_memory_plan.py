"""The memory plan on a CPU with a stand-in device size ($JAXINFER_DEVICE_MEMORY): a model that
cannot fit is refused before any weights file is read, with the numbers; the KV pool follows the
activations the compiled probe measures; those do not depend on the pool's size."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxinfer.model.tensor_sources as tensor_sources
import jaxinfer.model.weights as weights
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.kv_blocks import plan_kv_blocks
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.memory_preflight import preflight
from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import param_shapes
from jaxinfer.worker.activation_bytes import step_activation_bytes
from jaxinfer.worker.kv import MemoryPlanError
from jaxinfer.worker.kv.compile_scratch import (REDZONE_BYTES, CompilePlan,
                                                  gemm_autotune_bytes, plan_compiles)
from jaxinfer.worker.kv.planner import DEVICE_MEMORY_ENV, format_bytes
from jaxinfer.model.kernel_table import REFERENCE_KERNELS
from test_engine_support import tiny_model

DEMO = Path(__file__).parents[1] / "checkpoints" / "demo-target"
MIB = 1 << 20


def _spy_on_weight_reads(monkeypatch) -> list:
    """Every weights read the engine could start: load_params and safetensors' file opening."""
    reads = []
    real_load, real_open = weights.load_params, tensor_sources.safe_open
    monkeypatch.setattr(weights, "load_params",
                        lambda *a, **k: reads.append(("load_params", a[0])) or real_load(*a, **k))
    monkeypatch.setattr(tensor_sources, "safe_open",
                        lambda path, **k: reads.append(("safe_open", path)) or real_open(path, **k))
    return reads


def test_a_model_that_cannot_fit_is_refused_before_its_weights_load(monkeypatch):
    """The demo model's bf16 weights (~27 MiB) and one 1024-token sequence (4 MiB of KV) on a
    32 MiB device at 0.9: refused with the figures and a --max-model-len that fits, and no
    weights file opened; on a 256 MiB device the same engine loads (the spy sees the read)."""
    reads = _spy_on_weight_reads(monkeypatch)
    args = EngineArgs(model=str(DEMO), max_model_len=1024, max_num_seqs=4,
                      max_num_batched_tokens=64, warmup=False, compilation_cache_dir=None)
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "32MiB")
    with pytest.raises(MemoryPlanError) as refused:
        LLMEngine.from_engine_args(args)
    message = str(refused.value)
    assert reads == []
    cfg = load_config(DEMO)
    figures = preflight(cfg, args, param_shapes(cfg, jnp.bfloat16), None, jnp.bfloat16)
    assert not figures.fits and 0 < figures.fitting_model_len < 1024
    assert figures.sequence_kv_bytes == 1024 * 2 * 8 * 2 * 64 * 2  # tokens × 2 × L × H × d × 2 B
    for text in (f"{format_bytes(figures.weight_bytes)} for weights",
                 "4.00 MiB of KV cache for one sequence of max_model_len=1024",
                 "the device has 32.00 MiB, 28.80 MiB at --gpu-memory-utilization 0.9",
                 f"lower --max-model-len to {figures.fitting_model_len}"):
        assert text in message, (text, message)
    # The length it names fits: the same check passes there.
    shorter = dataclasses.replace(args, max_model_len=figures.fitting_model_len)
    assert preflight(cfg, shorter, param_shapes(cfg, jnp.bfloat16), None, jnp.bfloat16).fits

    monkeypatch.setenv(DEVICE_MEMORY_ENV, "256MiB")
    engine = LLMEngine.from_engine_args(args)
    assert reads and reads[0][0] == "load_params"
    assert engine.memory_plan["preflight"]["fits"]
    assert engine.memory_plan["kv"]["device_bytes"] == 256 * MIB


def test_weights_alone_too_large_say_so(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "16MiB")
    reads = _spy_on_weight_reads(monkeypatch)
    with pytest.raises(MemoryPlanError, match="the weights alone leave no room"):
        LLMEngine.from_engine_args(EngineArgs(model=str(DEMO), max_model_len=256, warmup=False,
                                              compilation_cache_dir=None))
    assert reads == []


def _probe(cfg, params, tokens: int, probe_blocks: int = 2) -> int:
    return step_activation_bytes(cfg, params, REFERENCE_KERNELS, kv_dtype=jnp.float32,
                                 block_size=4, max_model_len=64, max_num_seqs=8,
                                 max_num_batched_tokens=tokens, probe_blocks=probe_blocks)


def test_the_measured_activations_do_not_depend_on_the_pool_size():
    """The pool's size is a static shape of the step executables, so the planner measures at a
    two-block probe pool: the cache is donated and aliased, and the figure is the same at 64 and
    1024 blocks. (One block is degenerate: XLA simplifies its gathers, the temp comes out
    smaller.)"""
    cfg, params = tiny_model()
    probe = _probe(cfg, params, 32)
    assert probe == _probe(cfg, params, 32, probe_blocks=64)
    assert probe == _probe(cfg, params, 32, probe_blocks=1024)


def test_the_pool_follows_the_measured_activations(monkeypatch):
    """On a stand-in 8 MiB device, a larger largest bucket measures more activations and the
    pool shrinks by exactly those bytes (to the block)."""
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "8MiB")
    cfg, params = tiny_model()
    plans = {}
    for tokens in (32, 512):
        args = EngineArgs(model="tiny", max_model_len=64, max_num_seqs=8, block_size=4,
                          max_num_batched_tokens=tokens, dtype="float32",
                          attention_backend="reference", compilation_cache_dir=None)
        plans[tokens] = plan_kv_blocks(cfg, args, params)
        assert plans[tokens].activation_bytes == _probe(cfg, params, tokens)
    small, large = plans[32], plans[512]
    grown = large.activation_bytes - small.activation_bytes
    assert grown > 0 and large.num_blocks < small.num_blocks
    assert small.num_blocks - large.num_blocks == pytest.approx(grown / small.bytes_per_block,
                                                                abs=1)
    assert small.compile_scratch_bytes == 0  # only a GPU autotunes on the device


def test_the_autotuner_scratch_is_the_lm_head_for_llama8b():
    """Issue 60's OOM: 1018 MiB = the 128256 × 4096 bf16 LM head + 2 redzones; the estimate
    covers that weight, its activations and the redzones of its four buffers."""
    head = jax.ShapeDtypeStruct((4096, 128256), jnp.bfloat16)
    mlp = jax.ShapeDtypeStruct((4096, 28672), jnp.bfloat16)
    got = gemm_autotune_bytes({"head": head, "mlp": mlp}, vocab_size=128256, max_rows=2048,
                              max_logit_rows=256)
    lm_head = 4096 * 128256 * 2
    assert lm_head + 2 * REDZONE_BYTES == 1018 * MIB
    assert got == lm_head + 256 * (4096 * 2 + 2 * 128256 * 4) + 8 * REDZONE_BYTES


def test_compiles_at_once_are_bounded_by_the_scratch_share():
    """Room for 8 of Llama-8B's LM-head autotunes (~10 GiB) is more than a tenth of an H100's
    allocator (59.7 GiB): 4 compiles run at once there, 8 on an H200 (105 GiB); a CPU keeps no
    room and runs them all; one compile always runs, however large its GEMM."""
    params = {"head": jax.ShapeDtypeStruct((4096, 128256), jnp.bfloat16)}
    kw = dict(vocab_size=128256, max_rows=2048, max_logit_rows=256, max_workers=8)
    one = gemm_autotune_bytes(params, vocab_size=128256, max_rows=2048, max_logit_rows=256)
    h100 = plan_compiles(params, device_bytes=int(59.7 * 2**30), platform="gpu", **kw)
    h200 = plan_compiles(params, device_bytes=int(105.3 * 2**30), platform="gpu", **kw)
    assert (h100.workers, h100.scratch_bytes) == (4, 4 * one)
    assert (h200.workers, h200.scratch_bytes) == (8, 8 * one)
    assert plan_compiles(params, device_bytes=2**30, platform="gpu", **kw).workers == 1
    assert plan_compiles(params, device_bytes=2**30, platform="cpu", **kw) == (
        plan_compiles(params, device_bytes=2**40, platform="cpu", **kw)) == CompilePlan(8, 0)


def test_jaxinfer_memory_shows_the_engines_own_check(capsys, monkeypatch):
    """`jaxinfer memory --model` reports the same pre-load figures the engine refuses with, on
    the card's memory (the engine gives JAX's allocator --gpu-memory-utilization of it), or on
    the allocator's share where XLA_CLIENT_MEM_FRACTION sets a smaller one."""
    import json
    from jaxinfer.cli.main import build_parser
    from jaxinfer.worker.kv.planner import MEM_FRACTION_ENVS
    for name in MEM_FRACTION_ENVS:
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    argv = ["memory", "--model", str(DEMO), "--accelerator", "1", "--seq-len", "1024",
            "--batch", "4", "--json"]
    args = parser.parse_args(argv)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.75")
    assert args.func(args) == 0
    plan = json.loads(capsys.readouterr().out)["engine_plan"]
    assert plan["device_bytes"] == int(0.75 * 2**30 / 0.9) and plan["allocator_fraction"] == 0.75
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    assert args.func(args) == 0
    plan = json.loads(capsys.readouterr().out)["engine_plan"]
    assert plan["device_bytes"] == 2**30 and plan["fits"]
    assert plan["compile_scratch_bytes"] >= 8 * REDZONE_BYTES  # one compile's redzones at least
    cfg = load_config(DEMO)
    args = EngineArgs(model=str(DEMO), max_model_len=1024, max_num_seqs=4)
    same = preflight(cfg, args, param_shapes(cfg, jnp.bfloat16), None, jnp.bfloat16,
                     device_bytes=plan["device_bytes"], platform="gpu", workers=8)
    assert {**same.as_dict(), "allocator_fraction": 0.9} == plan


def test_the_probe_covers_every_compiled_bucket():
    """After warm-up at the real pool size, the planned figure (largest mixed forward + the
    largest sampler variant) is at least what every compiled forward, loop and sampler measure;
    warm-up runs as many compiles at once as the plan kept autotune room for."""
    from jaxinfer.engine.kv_blocks import with_compiled_peak
    from test_engine_support import make_engine
    engine = make_engine(warmup=False, background_compile=False)
    engine.memory_plan = {"kv": {"compile_workers": 1}}
    engine.warmup(progress=False)
    assert engine.runner.compiler._pool._max_workers == 1
    c, r = engine.config, engine.runner
    planned = step_activation_bytes(engine.cfg, r.params, REFERENCE_KERNELS,
                                    kv_dtype=r.kv_cache[0][0].dtype, block_size=c.cache.block_size,
                                    max_model_len=engine.max_model_len,
                                    max_num_seqs=c.scheduler.max_num_seqs,
                                    max_num_batched_tokens=c.scheduler.max_num_batched_tokens)
    plan = with_compiled_peak({"kv": {"activation_bytes": planned}}, r)
    assert plan["compiled_executables"] >= 3
    assert 0 < plan["compiled_peak_bytes"] <= planned


def test_bench_memory_plan_tells_an_oom_from_a_refusal_and_a_death(monkeypatch, tmp_path, capsys):
    """`jaxinfer bench memory-plan`'s record, with each model's process stood in for: one ran,
    one was refused before loading, one raised RESOURCE_EXHAUSTED, one died in XLA."""
    import json
    from jaxinfer.bench import memory_plan as bench
    outcomes = {
        "llama8b": {"oom": False, "peak_bytes_in_use": 7, "device_kind": "NVIDIA H100 80GB HBM3",
                    "memory_plan": {"kv": {"num_blocks": 3, "activation_bytes": 5},
                                    "compiled_peak_bytes": 4}},
        "llama8b_fp8": MemoryPlanError("the model does not fit"),
        "qwen3_30b_a3b": RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                      "allocate 1018.00MiB"),
    }

    def fake_child(argv, timeout):
        name = argv[argv.index("--child") + 1]
        if name == "gpt_oss_20b":
            return "", "F external/xla/...: Out of memory allocating 1 bytes\nAborted", -6
        outcome = outcomes[name]
        if isinstance(outcome, Exception):
            monkeypatch.setattr(bench, "run_model", lambda *_: (_ for _ in ()).throw(outcome))
        else:
            monkeypatch.setattr(bench, "run_model", lambda *_: dict(outcome))
        monkeypatch.setattr(bench, "_device_memory", lambda: {})
        bench._child(name, None)
        return capsys.readouterr().out, "", 0

    monkeypatch.setattr(bench.common, "child", fake_child)
    parser = __import__("argparse").ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["memory-plan", "--save", str(tmp_path)])
    assert bench.run(args) == 1  # an OOM fails the run
    m = json.loads((tmp_path / "memory_plan_h100.json").read_text())["metrics"]
    assert m["llama8b_oom"] is False and m["llama8b_plan_num_blocks"] == 3
    assert m["llama8b_compiled_peak_bytes"] == 4 and m["llama8b_peak_bytes_in_use"] == 7
    assert m["llama8b_fp8_refused"] is True and m["llama8b_fp8_oom"] is False
    assert m["qwen3_30b_a3b_oom"] is True and m["gpt_oss_20b_oom"] is True
    assert m["any_oom"] is True
