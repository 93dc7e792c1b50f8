"""LoRA serving cost at Llama-3-8B shape (dummy weights, rank-16 adapters on all seven
projections), each figure divided by the base model's measured in the same run:

    jaxinfer bench throughput --suite lora --save      # H200: benchmarks/results/lora_h200.json
    BENCH_TINY_SHAPES=1 JAX_PLATFORMS=cpu jaxinfer bench throughput --suite lora   # CPU check

Three engine processes, one after the other on the same GPU: `base` (no LoRA), then one per LoRA
implementation (`--lora-impl xla` and `pallas`, each --enable-lora --max-loras 8
--max-lora-rank 16; `--impls pallas` measures one). Each runs the same workload:
- c64: 64 requests of 512 random prompt tokens, 256 output tokens each (ignore_eos), submitted at
  once; in the lora process request i runs adapter i % 8 -> `lora_c64_8adapters_over_base`
  (output tok/s ratio, goal >= 0.85);
- bs1: one request, 512 in / 129 out, minus the same with 1 out, per decoded token ->
  `lora_bs1_tpot_over_base` (goal <= 1.10);
- prefill: one 2048-token prompt, 1 output token (one chunk) -> `lora_prefill_2048_over_base`
  (goal <= 1.15);
- load (lora only): a c = 64 run on 7 adapters during which a request of a 9th, cold adapter
  (registered now: read from disk, checked, written into the free slot) arrives; `lora_load_s` is
  the host read + check + the slot write until the device has it, `lora_load_itl_p99_ms` the
  inter-token latency p99 of the running streams over that run (anchor: `itl_p99_ms` of the same
  run without the load).
Every metric is written per implementation (`<key>_xla`, `<key>_pallas`); the unsuffixed keys are
the default implementation's (`default_lora_impl`, EngineArgs.lora_impl), so the record stays
comparable with earlier runs. Every timed prompt is new (random tokens never used before), so the
prefix cache cannot skip prefill; `prefix_hit_rate` is recorded. Compilation is not timed: the
engines compile lazily, and untimed runs of every shape come first (bs1 and prefill take the best
of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxinfer.bench import results_io

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001}
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "torch_dtype": "float32"}
NUM_ADAPTERS = 9  # 8 for the c64 run, a 9th cold one for the load


def shapes(tiny: bool) -> dict:
    if tiny:
        return dict(conc=8, in_len=32, out_len=16, prefill=128, bs1_out=17, rank=4, max_len=160)
    return dict(conc=64, in_len=512, out_len=256, prefill=2048, bs1_out=129, rank=16,
                max_len=2064)


def write_inputs(work: Path, tiny: bool) -> None:
    """The model's config.json and NUM_ADAPTERS random PEFT adapters (rank 16, all projections)."""
    from jaxinfer.model.config import load_config
    from jaxinfer.model.lora.peft import LoRAAdapter, layer_projections, projection_shape
    from jaxinfer.model.lora.peft import save_adapter
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(TINY if tiny else LLAMA3_8B))
    cfg = load_config(work / "model")
    rank = shapes(tiny)["rank"]
    for i in range(NUM_ADAPTERS):
        rng = np.random.default_rng(i)
        weights = {}
        for layer in range(cfg.num_layers):
            for proj in layer_projections(cfg, layer):
                fan_in, fan_out = projection_shape(cfg, proj)
                weights[(layer, proj)] = (
                    rng.standard_normal((fan_in, rank), np.float32) * fan_in ** -0.5,
                    rng.standard_normal((rank, fan_out), np.float32) * 0.01)
        save_adapter(LoRAAdapter(f"a{i}", rank, 2.0, weights), cfg, work / f"a{i}")


MODES = ("base", "xla", "pallas")  # no LoRA, then each --lora-impl


def run_engine(work: Path, mode: str, tiny: bool) -> dict:
    """One engine process's measurements (mode: one of MODES)."""
    import jax
    from jaxinfer import LLM, LoRARequest, SamplingParams
    s = shapes(tiny)
    kw = dict(load_format="dummy", max_model_len=s["max_len"], max_num_seqs=s["conc"],
              max_num_batched_tokens=max(2048, s["prefill"]), long_prefill_chunk=s["prefill"],
              warmup=False, compilation_cache_dir=None)  # (the warm-up runs compile what is timed)
    kw.update(dict(dtype="float32", num_blocks=256) if tiny else
              dict(dtype="bfloat16", gpu_memory_utilization=0.85))
    lora = mode != "base"
    if lora:
        kw.update(enable_lora=True, max_loras=8, max_lora_rank=s["rank"],
                  max_cpu_loras=NUM_ADAPTERS, lora_impl=mode)
    llm = LLM(str(work / "model"), **kw)
    engine = llm.engine
    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(MODES.index(mode) + 1)
    loras = [LoRARequest(f"a{i}", i + 1, str(work / f"a{i}")) for i in range(NUM_ADAPTERS)]

    def prompts(n: int, length: int) -> list[list[int]]:  # never seen before: no prefix hits
        return [rng.integers(0, vocab, length).tolist() for _ in range(n)]

    def lora_of(i: int, count: int = 8):
        return loras[i % count] if lora else None

    def generate(ps, max_tokens: int, adapters) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False, lora_request=adapters)
        return time.perf_counter() - t0

    out: dict = {}
    c, il, ol = s["conc"], s["in_len"], s["out_len"]
    # Warm-up: every adapter of the c64 run into its slot, every shape once (untimed prompts).
    generate(prompts(c, il), ol, [lora_of(i) for i in range(c)])  # (decode loops too)
    generate(prompts(1, s["prefill"]), 1, [lora_of(0)])
    stats = engine.scheduler.kv.stats
    q0, h0 = stats.queries, stats.hits
    elapsed = generate(prompts(c, il), ol, [lora_of(i) for i in range(c)])
    out["c64_output_tok_s"] = c * ol / elapsed
    one = [lora_of(0)]
    t1 = min(generate(prompts(1, il), 1, one) for _ in range(3))
    tn = min(generate(prompts(1, il), s["bs1_out"], one) for _ in range(3))
    out["bs1_tpot_ms"] = (tn - t1) / (s["bs1_out"] - 1) * 1e3
    out["prefill_2048_s"] = min(generate(prompts(1, s["prefill"]), 1, one) for _ in range(3))
    out["itl_p99_ms"] = itl_run(engine, prompts(c, il), ol, [lora_of(i, 7) for i in range(c)])
    if lora:
        load = {}
        out["load_itl_p99_ms"] = itl_run(engine, prompts(c, il), ol,
                                         [lora_of(i, 7) for i in range(c)],
                                         cold=(loras[NUM_ADAPTERS - 1], prompts(1, il)[0], load))
        out["load_s"] = load["s"]
    out["prefix_hit_rate"] = (stats.hits - h0) / max(stats.queries - q0, 1)
    out["platform"] = jax.devices()[0].platform
    return out


def itl_run(engine, prompts, out_len: int, adapters, cold=None) -> float:
    """Step the engine over `prompts` (all added at once); the p99 of the gaps between a stream's
    successive outputs. `cold` (LoRARequest, prompt, result dict): once every stream decodes,
    register that adapter (timed with its slot write) and add its request."""
    from jaxinfer import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    base = f"itl{time.perf_counter_ns()}"
    for i, (p, lora) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"{base}-{i}", p, params, lora_request=lora)
    last: dict[str, float] = {}
    gaps: list[float] = []
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
        steps += 1
        if cold is not None and steps == out_len // 4:
            lora, prompt, result = cold
            write = engine._write_lora_slot
            timed = {"s": 0.0}

            def timed_write(slot, adapter):
                t = time.perf_counter()
                write(slot, adapter)
                import jax
                jax.block_until_ready(engine.runner.params["lora"])
                timed["s"] += time.perf_counter() - t

            engine._write_lora_slot = timed_write
            engine.lora._write = timed_write
            t0 = time.perf_counter()
            engine.add_lora(lora)  # disk read + checks
            result["s"] = time.perf_counter() - t0
            engine.add_request(f"{base}-cold", prompt, params, lora_request=lora)
            while engine.lora.slot_of(lora.lora_name) is None and engine.has_unfinished_requests():
                for o in engine.step():
                    last[o.request_id] = time.perf_counter()
            result["s"] += timed["s"]
            cold = None
    return float(np.percentile(gaps, 99) * 1e3) if gaps else 0.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", default=bool(os.environ.get("BENCH_TINY_SHAPES")),
                    help="tiny shapes (CPU check; also $BENCH_TINY_SHAPES=1)")
    ap.add_argument("--impls", default=",".join(MODES[1:]),
                    help="the --lora-impl values to measure, comma-separated (default: all)")
    ap.add_argument("--engine-process", nargs=2, metavar=("WORK", "MODE"), help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, "lora_<gpu>")
    args = ap.parse_args(argv)
    if args.engine_process:
        work, mode = args.engine_process
        print("RESULT " + json.dumps(run_engine(Path(work), mode, args.tiny)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    t0 = time.perf_counter()
    write_inputs(work, args.tiny)
    print(f"inputs written in {time.perf_counter() - t0:.1f} s", flush=True)
    runs = {}
    impls = [i for i in MODES[1:] if i in args.impls.split(",")]
    if not impls:
        sys.exit(f"--impls {args.impls!r}: choose from {', '.join(MODES[1:])}")
    for mode in ["base", *impls]:
        cmd = [sys.executable, "-m", "jaxinfer.bench.suites.lora", "--engine-process", str(work), mode]
        cmd += ["--tiny"] if args.tiny else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the {mode} engine failed:\n{proc.stderr[-4000:]}")
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        runs[mode] = json.loads(line[len("RESULT "):])
        print(mode, f"({time.perf_counter() - t0:.0f} s)", runs[mode], flush=True)
    # --lora-impl auto's choice on the children's platform (lora_args.resolved_lora_impl, TP 1)
    default = "pallas" if runs["base"].get("platform") == "gpu" else "xla"
    metrics = {}
    for impl in impls:
        for key, value in impl_metrics(runs["base"], runs[impl]).items():
            metrics[f"{key}_{impl}"] = value
            if impl == default:
                metrics[key] = value
    base = runs["base"]
    metrics.update(base_itl_p99_ms=round(base["itl_p99_ms"], 2),
                   base_c64_output_tok_s=round(base["c64_output_tok_s"], 1),
                   base_bs1_tpot_ms=round(base["bs1_tpot_ms"], 3),
                   base_prefill_2048_s=round(base["prefill_2048_s"], 4),
                   prefix_hit_rate=max(r["prefix_hit_rate"] for r in runs.values()))
    print(json.dumps(metrics, indent=2))
    if args.save:
        name = args.name or ("lora_tiny_" if args.tiny else "lora_") + results_io.device_slug()
        results_io.save(args.save, name, metrics=metrics, config=dict(
            model="llama3-8b-shape dummy" if not args.tiny else "tiny llama dummy",
            adapters=NUM_ADAPTERS, max_loras=8, projections="q,k,v,o,gate,up,down",
            lora_impls="xla (model/lora/delta.py), pallas (pallas_kernels/lora)",
            default_lora_impl=default, measured_impls=impls, **shapes(args.tiny)))


def impl_metrics(base: dict, lora: dict) -> dict:
    """One LoRA implementation's figures, measured against the base model's of the same run."""
    return {
        "lora_c64_8adapters_over_base": round(lora["c64_output_tok_s"] / base["c64_output_tok_s"], 3),
        "lora_bs1_tpot_over_base": round(lora["bs1_tpot_ms"] / base["bs1_tpot_ms"], 3),
        "lora_prefill_2048_over_base": round(lora["prefill_2048_s"] / base["prefill_2048_s"], 3),
        "lora_load_s": round(lora["load_s"], 3),
        "lora_load_itl_p99_ms": round(lora["load_itl_p99_ms"], 2),
        "itl_p99_ms": round(lora["itl_p99_ms"], 2),
        "lora_c64_output_tok_s": round(lora["c64_output_tok_s"], 1),
        "lora_bs1_tpot_ms": round(lora["bs1_tpot_ms"], 3),
        "lora_prefill_2048_s": round(lora["prefill_2048_s"], 4),
    }

if __name__ == "__main__":
    main()
