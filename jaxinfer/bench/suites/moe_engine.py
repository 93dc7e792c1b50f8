"""The engine section of jaxinfer/bench/suites/moe.py: the engine end to end on an MoE model's shape
(dummy weights), output tok/s, the median decode step at full batch and the step mix."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from jaxinfer.bench.presets import MIXTRAL_8X7B, QWEN3_30B_A3B
from jaxinfer.bench.timed_window import TimedWindow

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"


ENGINE_MODELS = {"qwen": ("qwen3_30b_a3b", QWEN3_30B_A3B), "mixtral": ("mixtral_8x7b", MIXTRAL_8X7B)}
# BENCH_TINY_SHAPES=1: the same architectures at a CPU's size (the FP8 path needs hidden and
# expert intermediate multiples of 128 only on the kernel, not on the XLA paths a CPU runs).
TINY_SIZES = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 512, "num_experts": 8, "num_local_experts": 4,
              "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
# (prompts, prompt tokens, output tokens, max_model_len, max_num_batched_tokens)
WORKLOAD = (4, 32, 8, 128, 256) if TINY else (64, 512, 256, 1024, 2048)


def engine_section(model_key: str, backend: str = "mosaic", prompts: int = 64,
                   layers: int | None = None, quantization: str | None = None,
                   moe_impl: str = "auto") -> dict:
    import numpy as np

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams

    name, config = ENGINE_MODELS[model_key]
    if TINY:  # (on the CPU "auto" is the jnp attention)
        config = {**config, **{k: v for k, v in TINY_SIZES.items() if k in config}}
        backend = "auto"
    config = {**config, "num_hidden_layers": layers or config["num_hidden_layers"]}
    prompts, prompt_len, out_len, max_len, batched = WORKLOAD if TINY else (
        prompts, *WORKLOAD[1:])
    work = Path(tempfile.mkdtemp(prefix="moe-"))
    (work / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    args = EngineArgs(model=str(work), load_format="dummy", dtype="bfloat16", max_num_seqs=prompts,
                      max_num_batched_tokens=batched, max_model_len=max_len,
                      gpu_memory_utilization=0.9, attention_backend=backend,
                      quantization=quantization, moe_impl=moe_impl,
                      background_compile=False)  # timed steps never run padded into a bigger bucket
    engine = LLMEngine.from_engine_args(args)
    ready_s = time.perf_counter() - t0  # weights made on device + every bucket compiled
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i in range(prompts):
        engine.add_request(f"r{i}", rng.integers(0, config["vocab_size"], prompt_len).tolist(),
                           params)
    stamps, n_out = [], 0
    kv_stats = engine.scheduler.kv.stats
    q0, h0 = kv_stats.queries, kv_stats.hits
    engine.stats.__init__()
    window = TimedWindow(engine)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        prefill = sched.num_waiting > 0 or any(s.num_computed < s.prompt_len for s in sched.running)
        outs = engine.step()
        stamps.append((time.perf_counter(), len(sched.running), prefill))
        n_out += sum(o.num_generated_tokens for o in outs if o.finished)
    elapsed = time.perf_counter() - start
    # Steady decode: consecutive steps with all 64 sequences running, past the prefill steps.
    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:]) if a[1] == prompts and b[1] == prompts
            and not b[2]]
    gaps = gaps[len(gaps) // 4:]
    mix = step_mix(start, stamps)
    return {"model": name, "layers": config["num_hidden_layers"], "ready_s": round(ready_s, 1),
            "elapsed_s": round(elapsed, 2), "output_tokens": n_out,
            "out_tok_s": round(n_out / elapsed, 1), "steps": len(stamps),
            "decode_step_ms_median": round(1e3 * float(np.median(gaps)), 2) if gaps else None,
            "host_ms_per_step": round(engine.stats.host_ms_per_step, 3),
            "sync_gap_ms": round(engine.stats.sync_gap_ms, 3), **mix, **window.figures(),
            "prefix_hit_rate": round((kv_stats.hits - h0) / max(kv_stats.queries - q0, 1), 4),
            "moe_impl": moe_impl, "quantization": quantization}


def step_mix(start: float, stamps: list) -> dict:
    """Where the wall time went: steps that carried prompt tokens against pure-decode steps (count,
    summed and median wall ms between consecutive step returns)."""
    import numpy as np

    out = {}
    times = [start] + [s[0] for s in stamps]
    for kind, flag in (("prefill", True), ("decode", False)):
        d = [b - a for a, b, s in zip(times, times[1:], stamps) if s[2] == flag]
        out[f"{kind}_steps"] = len(d)
        out[f"{kind}_wall_s"] = round(float(sum(d)), 3)
        out[f"{kind}_step_ms_p50"] = round(1e3 * float(np.median(d)), 2) if d else None
    return out
