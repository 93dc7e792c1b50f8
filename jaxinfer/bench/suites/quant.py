"""FP8 weights (`--quantization fp8`) on the GPU, beside their bf16 anchors measured in the same run.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite quant -- [--sections ...]
        [--deadline-s 140] [--matmul-rows 2048,8,256] [--kv-cache-dtype fp8] [--save [DIR]]
    JAX_PLATFORMS=cpu jaxinfer bench throughput --suite quant -- --tiny \
        --sections llama8b_fp8w,llama8b_fp8w_c256   # CPU check: a 2-layer model, c = 8

Sections (each in its own process, so a crash or a timeout keeps the others' figures; they share
one persistent compilation cache; the record is rewritten after each):
  matmul        Llama-3-8B's projections, fused as the engine serves them (qkv, o, gate_up, down),
                4 layers unrolled as the model unrolls them (1.7 GB
                of bf16 weights, every one read once per call as a decode step reads them), at
                the --matmul-rows row counts (default M = 2048, a prefill chunk; 8, the batch-1
                decode bucket; 256, c = 256 decode), for bf16 weights, FP8 W8A8 ("fp8": per-token
                e4m3 activations, XLA's cuBLASLt FP8 gemm) and, at decode sizes, FP8 weight-only
                ("dequant": e4m3 converted inside XLA's dot): ms per call, weight-read GB/s, TF/s,
                and whether the optimized HLO holds the `__cublas$lt$matmul$f8` custom call.
  demo_ppl      the bundled demo model in bf16, its weights unquantized, FP8 and int8 weight-only:
                held-out perplexity (checkpoints/heldout_sample.txt) and greedy top-1 agreement.
  llama8b_bf16  Llama-3-8B shape, dummy bf16 weights: batch-1 TPOT (the anchor).
  llama8b_fp8w  the same weights quantized on load: batch-1 TPOT.
  llama8b_fp8w_c256  FP8 weights: c = 256 random 512 in / 256 out (bf16 KV cache).
  llama8b_fp8w_fp8kv  c = 256 with FP8 weights and --kv-cache-dtype (default fp8), then batch 1
                in the same engine.
Engines: 256 sequences, 2048-token steps, max_model_len 1024 (see
jaxinfer/bench/suites/multi_gpu.py, whose timing helpers these sections share). Batch-1 sections
compile their two step shapes lazily; c = 256 sections compile every bucket before they are timed
(the MoE suite's engine section: with background
compilation the decode steps run padded into the 2048-token bucket until their own is ready, and
lazy compiles would stall the warm-up run; `<section>_ready_s` is load + every bucket).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.common import child
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.bench.suites.multi_gpu import _batch1, _engine_kw, _last_json, _llm, _throughput
from jaxinfer.paths import REPO_ROOT

ROWS = "2048,8,256"  # in the order measured: the prefill ratio first, then decode sizes
LAYERS = 4
CUBLASLT_FP8 = "__cublas$lt$matmul$f8"


# ---- sections (run inside a child process) ------------------------------------------------------
def _announce_machine() -> None:
    """The accelerator, printed first so a section cut short still names it."""
    import jax
    print(json.dumps({"machine": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}),
          flush=True)


def _projections(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of one layer's projections, fused as the engine serves them on one
    device (jaxinfer/model/fused_projections.py): q/k/v as qkv, gate/up as gate_up."""
    h, f, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * f, h), "down": (h, f)}


def _layer_stack_fn(impl: str):
    """One call = LAYERS layers of the four projections, each layer's output the next's input
    (unrolled: a loop would slice each layer's weights out of a stack, which XLA may copy)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.quant.ops import quantized_matmul

    def mm(x, p, name):
        if impl == "bf16":
            return jnp.dot(x, p[name].T, preferred_element_type=jnp.float32).astype(x.dtype)
        return quantized_matmul(x, p[name], p[name + "_scale"], impl=impl)

    def layer(x, p):
        x = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                               + 1e-5)).astype(x.dtype)
        h = x.shape[1]
        qkv = mm(x, p, "qkv")
        q, kv = qkv[:, :h], qkv[:, h:]
        attn = mm(q + jnp.tile(kv, (1, h // kv.shape[1])), p, "o")
        gate, up = jnp.split(mm(x, p, "gate_up"), 2, axis=-1)
        return x + attn + mm(jax.nn.silu(gate) * up, p, "down")

    def run(x, layers):
        for p in layers:
            x = layer(x, p)
        return x
    return jax.jit(run)


def section_matmul(cfg: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.model.quant.ops import quantize

    _announce_machine()
    shapes = _projections(LLAMA3_8B)
    key = jax.random.key(0)
    normal = jax.jit(lambda k, shape: (jax.random.normal(k, shape) * 0.02).astype(jnp.bfloat16),
                     static_argnums=1)
    to_fp8 = jax.jit(lambda w: quantize(w, "fp8"))
    bf16, fp8 = [{} for _ in range(LAYERS)], [{} for _ in range(LAYERS)]
    for layer in range(LAYERS):
        for i, (name, shape) in enumerate(shapes.items()):
            w = normal(jax.random.fold_in(key, layer * 16 + i), shape)
            bf16[layer][name] = w
            fp8[layer][name], fp8[layer][name + "_scale"] = to_fp8(w)
    weight_params = LAYERS * sum(n * k for n, k in shapes.values())
    out: dict = {"matmul_weight_params": weight_params}
    params = {"bf16": bf16, "fp8": fp8, "dequant": fp8}
    fns = {impl: _layer_stack_fn(impl) for impl in params}
    for m in (int(r) for r in cfg["matmul_rows"].split(",")):
        for impl in ("fp8", "bf16") if m >= 2048 else ("dequant", "fp8", "bf16"):
            fn = fns[impl]
            x = jax.random.normal(key, (m, LLAMA3_8B["hidden_size"]), jnp.bfloat16)
            compiled = fn.lower(x, params[impl]).compile()
            hlo = compiled.as_text()
            if os.environ.get("QUANT_HLO_DIR"):  # the gemm and fusion lines, for a reader
                lines = [ln.strip()[:400] for ln in hlo.splitlines()
                         if "custom-call" in ln or "kind=kCustom" in ln][:60]
                with open(Path(os.environ["QUANT_HLO_DIR"]) / "matmul_hlo.txt", "a") as f:
                    f.write(f"==== {impl} m={m}\n" + "\n".join(lines) + "\n")
            if impl != "bf16":
                out[f"matmul_{impl}_m{m}_cublaslt_f8"] = CUBLASLT_FP8 in hlo
            # Weights copied into a merged gemm's operand every call (XLA's dot merging).
            out[f"matmul_{impl}_m{m}_weight_concats"] = len(
                re.findall(r"%wrapped_concatenate[.\d]* = ", hlo))
            # What XLA made of the dots: cuBLAS(Lt) custom calls, or its own Triton gemm fusions.
            out[f"matmul_{impl}_m{m}_gemms"] = sorted(
                set(re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo))
                | ({"__triton_gemm"} if "__triton_gemm" in hlo else set()))
            jax.block_until_ready(compiled(x, params[impl]))
            times = []
            for _ in range(8):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(x, params[impl]))
                times.append(time.perf_counter() - t0)
            s = float(np.median(times))
            weight_bytes = weight_params * (2 if impl == "bf16" else 1)
            out[f"matmul_{impl}_m{m}_ms"] = round(s * 1e3, 3)
            out[f"matmul_{impl}_m{m}_weight_gbs"] = round(weight_bytes / s / 1e9, 1)
            out[f"matmul_{impl}_m{m}_tflops"] = round(2 * m * weight_params / s / 1e12, 1)
            print(json.dumps({k: v for k, v in out.items() if k.startswith(f"matmul_{impl}_m{m}_")}),
                  flush=True)
    return out


def section_demo_ppl(cfg: dict) -> dict:
    _announce_machine()
    from jaxinfer.bench.perplexity import quantized_accuracy
    demo = REPO_ROOT / "checkpoints" / "demo-target"
    acc, int8 = quantized_accuracy(demo, "fp8"), quantized_accuracy(demo, "int8")
    return {"demo_ppl_bf16": round(acc["ppl"], 4), "demo_ppl_fp8w": round(acc["ppl_quantized"], 4),
            "demo_fp8w_top1_agreement": round(acc["top1_agreement"], 4),
            "demo_ppl_int8w": round(int8["ppl_quantized"], 4),
            "demo_int8w_top1_agreement": round(int8["top1_agreement"], 4),
            "demo_positions": acc["positions"]}


def section_llama8b_bf16(cfg: dict) -> dict:
    llm, _ = _llm(cfg["llama8b"], **_engine_kw(cfg, 256))
    return _batch1(llm, {**cfg, "trace_steps": 0}, "llama8b_bf16", lambda tpot, first: {
        "llama8b_bf16_bs1_tpot_ms": round(tpot, 3),
        "llama8b_bf16_bs1_out_tok_s": round(1e3 / tpot, 1)})


def _compiled_llm(cfg: dict, **engine):
    """An engine with FP8 weights whose every step bucket is compiled on return (warm-up without
    background compilation), and the seconds that took."""
    llm, ready_s = _llm(cfg["llama8b"], quantization="fp8", warmup=True, background_compile=False,
                        **engine, **_engine_kw(cfg, cfg["concurrency"]))
    compiler = llm.engine.runner.compiler
    assert compiler.num_ready == compiler.num_units, "a step bucket did not compile"
    return llm, ready_s


def section_llama8b_fp8w(cfg: dict) -> dict:
    _announce_machine()
    llm, load_s = _llm(cfg["llama8b"], quantization="fp8", **_engine_kw(cfg, 256))
    out = _batch1(llm, {**cfg, "trace_steps": 0}, "llama8b_fp8w", lambda tpot, first: {
        "llama8b_fp8w_bs1_tpot_ms": round(tpot, 3),
        "llama8b_fp8w_bs1_out_tok_s": round(1e3 / tpot, 1),
        "llama8b_fp8w_ready_s": round(load_s + first, 1),
        "llama8b_fp8w_weight_bytes": llm.engine.metrics.registry.get_sample_value(
            "jaxinfer:weight_bytes", {"model_name": llm.engine.model_name})})
    return out


def section_llama8b_fp8w_c256(cfg: dict) -> dict:
    _announce_machine()
    llm, ready_s = _compiled_llm(cfg)
    out = {"llama8b_fp8w_c256_ready_s": round(ready_s, 1)}
    print(json.dumps(out), flush=True)
    return {**out, **_throughput(llm, cfg["concurrency"], 32, "llama8b_fp8w_c256")}


def section_llama8b_fp8w_fp8kv(cfg: dict) -> dict:
    """c = 256 first (the figure no other section measures), then batch 1 in the same engine."""
    _announce_machine()
    llm, ready_s = _compiled_llm(cfg, kv_cache_dtype=cfg["kv_cache_dtype"])
    print(json.dumps({"llama8b_fp8w_fp8kv_ready_s": round(ready_s, 1)}), flush=True)
    out = {"llama8b_fp8w_fp8kv_ready_s": round(ready_s, 1),
           **_throughput(llm, cfg["concurrency"], 32, "llama8b_fp8w_fp8kv_c256")}
    print(json.dumps(out), flush=True)  # kept if the batch-1 run times out
    return {**out, **_batch1(llm, {**cfg, "trace_steps": 0}, "llama8b_fp8w_fp8kv",
                             lambda tpot, first: {
                                 "llama8b_fp8w_fp8kv_bs1_tpot_ms": round(tpot, 3),
                                 "llama8b_fp8w_fp8kv_bs1_out_tok_s": round(1e3 / tpot, 1)})}


SECTIONS = {"matmul": (section_matmul, 150), "demo_ppl": (section_demo_ppl, 40),
            "llama8b_bf16": (section_llama8b_bf16, 70), "llama8b_fp8w": (section_llama8b_fp8w, 90),
            "llama8b_fp8w_c256": (section_llama8b_fp8w_c256, 240),
            "llama8b_fp8w_fp8kv": (section_llama8b_fp8w_fp8kv, 260)}
# The figures, by the section that measures them.
REQUIRED = {"llama8b_fp8w_bs1_out_tok_s": "llama8b_fp8w",
            "llama8b_fp8w_c256_out_tok_s": "llama8b_fp8w_c256",
            "llama8b_fp8w_fp8kv_c256_out_tok_s": "llama8b_fp8w_fp8kv", "demo_ppl_bf16": "demo_ppl",
            "demo_ppl_fp8w": "demo_ppl", "prefill_matmul_fp8_over_bf16": "matmul"}


def derive(m: dict) -> None:
    """Ratios of figures measured in the same run."""
    if "matmul_fp8_m2048_ms" in m and "matmul_bf16_m2048_ms" in m:
        m["prefill_matmul_fp8_over_bf16"] = round(m["matmul_bf16_m2048_ms"]
                                                  / m["matmul_fp8_m2048_ms"], 3)
    if "llama8b_fp8w_bs1_out_tok_s" in m and "llama8b_bf16_bs1_out_tok_s" in m:
        m["llama8b_fp8w_over_bf16_bs1"] = round(m["llama8b_fp8w_bs1_out_tok_s"]
                                                / m["llama8b_bf16_bs1_out_tok_s"], 3)
    if "demo_ppl_fp8w" in m and "demo_ppl_bf16" in m:
        m["demo_ppl_fp8w_over_bf16"] = round(m["demo_ppl_fp8w"] / m["demo_ppl_bf16"], 4)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--deadline-s", type=float, default=400.0)
    ap.add_argument("--limit", action="append", default=[], metavar="SECTION=SECONDS",
                    help="a section's time limit (default: its own, and never past --deadline-s)")
    ap.add_argument("--matmul-rows", default=ROWS,
                    help=f"the matmul section's row counts (default {ROWS})")
    ap.add_argument("--kv-cache-dtype", default="fp8",
                    help="the KV cache of the llama8b_fp8w_fp8kv section (default fp8)")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model, reference attention, c = 8 (a CPU check of the script)")
    ap.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, "quant_<gpu>")
    args = ap.parse_args(argv)
    if args.run_section:
        print(json.dumps(SECTIONS[args.run_section][0](json.loads(args.config))), flush=True)
        return
    limits = {name: limit for name, (_, limit) in SECTIONS.items()}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--limit {item!r}: expected SECTION=SECONDS with SECTION one of {', '.join(SECTIONS)}")
        limits[name] = float(seconds)
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-quant-"))
    (work / "llama8b").mkdir()
    if args.tiny:
        from jaxinfer.bench.suites.bs1_step import TINY
        os.environ.setdefault("BENCH_BACKEND", "reference")  # read by the sections' processes
    (work / "llama8b" / "config.json").write_text(json.dumps(TINY if args.tiny else LLAMA3_8B))
    cfg = {"cache_dir": str(work / "cc"), "llama8b": str(work / "llama8b"),
           "kv_cache_dtype": args.kv_cache_dtype, "matmul_rows": args.matmul_rows,
           "concurrency": 8 if args.tiny else 256}
    metrics: dict = {}
    sections: dict = {}
    machine = ""
    for name in args.sections.split(","):
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 20:
            sections[name] = "skipped: call deadline"
            continue
        t0 = time.perf_counter()
        argv = [sys.executable, "-m", __spec__.name, "--run-section", name, "--config", json.dumps(cfg)]
        stdout, stderr, rc = child(argv, min(limits[name], left))
        got = _last_json(stdout)
        machine = got.pop("machine", machine)
        metrics.update(got)
        sections[name] = {"wall_s": round(time.perf_counter() - t0, 1), "rc": rc}
        if rc != 0:
            sections[name]["stderr_tail"] = stderr[-2000:]
        print(f"== {name}: {json.dumps(got)} {json.dumps(sections[name])[:2000]}", flush=True)
        derive(metrics)
        for key, section in REQUIRED.items():  # a figure a section did not reach stays visible
            if section in sections:
                metrics.setdefault(key, None)
        if args.save:
            config: dict = {"sections": sections}
            if any(s.startswith("llama8b") for s in sections):
                config.update(
                    model="Llama-3-8B shape, dummy weights (bf16; fp8 quantized on load)",
                    workload="batch-1 TPOT over a 512-token prompt; c = 256 random 512 in / 256 out",
                    engine="max_num_seqs 256, max_num_batched_tokens 2048, max_model_len 1024, "
                           "mosaic attention", kv_cache_dtype_fp8kv_section=args.kv_cache_dtype)
            if "demo_ppl" in sections:
                config["demo"] = "checkpoints/demo-target, bf16, checkpoints/heldout_sample.txt"
            results_io.save(args.save, args.name or "quant_h200", metrics=metrics, config=config,
                            machine_info={**results_io.machine(), "accelerator": machine})
    print("\n".join(f"{k} | {v}" for k, v in metrics.items()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
