"""Routed experts on the GPU, one device call: the grouped-matmul kernel beside `ragged_dot` and the
padded einsum, against ceilings measured in the same run; then the engine end to end on MoE shapes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_moe.py [--sections kernels,qwen,mixtral]
        [--deadline-s 560] [--fp8] [--quantization fp8] [--save [DIR]]

Sections (each in its own process, time-limited; figures are saved after every part):
  kernels  ceilings (HBM read of 8 GiB; bf16 matmul 8192^3), then per model shape (Qwen3-30B-A3B:
           128 experts, hidden 2048, expert inter 768, top-8; Mixtral-8x7B: 8 experts, 4096,
           14336, top-2) and phase (decode: 64 tokens; prefill: 2048 tokens), with routing from a
           random router: correctness of every implementation against float32 `ragged_dot`, then
           the time of the whole expert MLP (gate, up, down) per implementation and of our kernel's
           two calls per tiling (`mosaic`: the tiling `moe_experts` picks; `mosaic_i`: SWEEP's).
           TB/s counts the touched experts' weight bytes once; TF/s 2 * rows * hidden * inter * 3.
           `--fp8`: beside them the same experts quantized to e4m3 (per-expert channel scales, as
           `--quantization fp8` stores them): our kernel's fp8 path (`fp8_mosaic`: the tiling
           `moe_experts` picks; `fp8_mosaic_i`: FP8_SWEEP's) and the XLA paths quantized experts
           run without it (`fp8_padded`, `fp8_ragged`), checked against float32 `ragged_dot` on the
           dequantized weights; their TB/s counts the e4m3 bytes. A table of both closes the run.
  qwen     the engine on the Qwen3-30B-A3B shape (dummy bf16), 64 prompts x 512 in / 256 out,
           --max-num-seqs 64: output tok/s and the median step while all 64 decode.
           `--quantization fp8`: every linear and expert e4m3 (experts on the kernel unless
           `--moe-impl xla`, or its check failed in `kernels`), saved as part `qwen_fp8`.
  mixtral  the same on the Mixtral-8x7B shape.
Parts go to $OUT/moe_h200.json as they finish; `--save` writes the record moe_<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import results_io

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", "/tmp"))

SHAPES = {  # experts, hidden, expert intermediate, top-k
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "mixtral_8x7b": (8, 4096, 14336, 2),
}
PHASE_TOKENS = {"decode": 64, "prefill": 2048}
# Tilings timed per phase beside `mosaic` (what `moe_experts` runs: `mosaic_configs`' pair):
# (gate/up fused, down) candidates; 4 fields make a GmmConfig (one-warpgroup kernel), 5 or 6 (with
# the consumers' split, and whether one ring runs across units) a WsConfig (warp-specialised).
SWEEP = {
    "decode": ([(64, 128, 64, 4), (64, 128, 64, 4, "n", True)],
               [(64, 128, 64, 6), (64, 256, 64, 4, "n", True)]),
    "prefill": ([(64, 128, 64, 4), (128, 128, 64, 4, "m", True)],
                [(128, 128, 64, 6), (128, 128, 64, 4, "m", True)]),
}
# e4m3 tilings timed beside `fp8_mosaic`: half the bytes per panel, so deeper rings fit, and at
# prefill consumers that split N (each widens only its half of the panel).
FP8_SWEEP = {
    "decode": ([(64, 128, 64, 6, "n")], [(64, 256, 64, 6, "n")]),
    "prefill": ([(64, 256, 64, 3, "n")], [(64, 256, 64, 4, "n")]),
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
ENGINE_MODELS = {"qwen": ("qwen3_30b_a3b", QWEN3_30B_A3B), "mixtral": ("mixtral_8x7b", MIXTRAL_8X7B)}


# ---- kernels -----------------------------------------------------------------------------------
def make_config(fields: tuple):
    from pallas_kernels.moe.grouped_matmul_mosaic import GmmConfig
    from pallas_kernels.moe.grouped_matmul_ws import WsConfig

    return WsConfig(*fields) if len(fields) > 4 else GmmConfig(*fields)


def config_fields(config) -> tuple:
    """The inverse of `make_config` (num_ctas left at its default)."""
    return dataclasses.astuple(config)[:6 if hasattr(config, "split") else 4]


def routed_case(experts, hidden, inter, top_k, tokens, seed=0):
    """x sorted by expert, weights, group sizes, and the unsorted layer input (x, chosen experts,
    routing weights): routing is top-k of a random router's softmax."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, experts), jnp.float32)
    probs, chosen = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ router), top_k)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // top_k]
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    std = hidden ** -0.5
    ws = tuple((jax.random.normal(k, s, jnp.float32) * std).astype(jnp.bfloat16)
               for k, s in zip(keys[2:], [(experts, hidden, inter), (experts, hidden, inter),
                                          (experts, inter, hidden)]))
    return xs, ws, sizes, (x, chosen, probs / probs.sum(-1, keepdims=True))


def fp8_case(ws, tokens: int, phase: str, sweep: bool, baselines) -> tuple:
    """The experts `ws` quantized as `--quantization fp8` stores them: (stacks, scales, float32
    reference inputs, calls: name -> f(x, stacks, scales, sizes), tilings)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.quant.ops import dequantize, quantize
    from pallas_kernels.moe import grouped_matmul as gm

    qs = [quantize(w, "fp8", axis=-2) for w in ws]
    wq, sq = tuple(q for q, _ in qs), tuple(s for _, s in qs)
    deq = tuple(dequantize(q, s, axis=-2) for q, s in qs)

    def pair(up, down):
        def f(x, ws, ss, sizes):
            h = gm.gmm(x.astype(jnp.float16), ws[:2], sizes, make_config(up), scales=ss[:2])
            return gm.gmm(h, ws[2:], sizes, make_config(down), scales=ss[2:], out_dtype=x.dtype)
        return jax.jit(f)

    def impl_call(impl):
        return jax.jit(lambda x, ws, ss, sizes: gm.moe_experts(
            x, ws, sizes, impl=impl, max_group_size=tokens, scales=ss))

    ups, downs = FP8_SWEEP[phase] if sweep else ((), ())
    tilings = {f"fp8_mosaic_{i}": p for i, p in enumerate(zip(ups, downs))}
    calls = {f"fp8_{impl}": impl_call(impl) for impl in ("mosaic", *baselines)}
    calls.update({name: pair(*p) for name, p in tilings.items()})
    return wq, sq, deq, calls, tilings


def kernel_section(deadline: float, models=tuple(SHAPES), sweep: bool = True,
                   phases=tuple(PHASE_TOKENS), baselines=("ragged", "padded"),
                   fp8: bool = False, fp8_sweep: bool = True) -> dict:
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks.bench_decode import read_ceiling_tbps, warm_up_gpu
    from benchmarks.bench_prefill import bench_interleaved, rel_err
    from jaxinfer.model.experts import routed_experts
    from pallas_kernels.moe import grouped_matmul as gm

    start = time.perf_counter()
    res: dict = {}
    warm_up_gpu()
    res["hbm_read_tbps"] = read_ceiling_tbps()
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    t = bench_interleaved({"mm": (mm, (a,))}, reps=5, inner=10)["mm"]
    res["matmul_tfs"] = 2 * 8192 ** 3 / t / 1e12
    del a
    print(f"ceilings: HBM read {res['hbm_read_tbps']:.2f} TB/s, bf16 matmul {res['matmul_tfs']:.0f} "
          f"TF/s", flush=True)
    save_part("kernels", res)

    def time_parts(xs, ws, sizes, up, down):
        h = gm.gmm(xs, ws[:2], sizes, make_config(up))
        parts = bench_interleaved({
            "up": (functools.partial(gm.gmm, config=make_config(up)), (xs, ws[:2], sizes)),
            "down": (functools.partial(gm.gmm, config=make_config(down)), (h, ws[2:], sizes))},
            reps=3, inner=10)
        return {k: round(v * 1e6, 1) for k, v in parts.items()}

    def time_fp8_parts(xs, wq, sq, sizes, up, down):
        x16 = xs.astype(jnp.float16)
        up_f = functools.partial(gm.gmm, config=make_config(up), scales=sq[:2])
        down_f = functools.partial(gm.gmm, config=make_config(down), scales=sq[2:],
                                   out_dtype=xs.dtype)
        h = up_f(x16, wq[:2], sizes)
        parts = bench_interleaved({"up": (up_f, (x16, wq[:2], sizes)),
                                   "down": (down_f, (h, wq[2:], sizes))}, reps=3, inner=10)
        return {k: round(v * 1e6, 1) for k, v in parts.items()}

    def mosaic_pair(up, down):
        def f(x, ws, sizes):
            h = gm.gmm(x, ws[:2], sizes, make_config(up))
            return gm.gmm(h, ws[2:], sizes, make_config(down))
        return jax.jit(f)

    for model in models:
        e, hidden, inter, k = SHAPES[model]
        for phase in phases:
            tokens = PHASE_TOKENS[phase]
            if time.perf_counter() - start > deadline:
                res[f"{model}_{phase}"] = "skipped: deadline"
                continue
            xs, ws, sizes, layer_in = routed_case(e, hidden, inter, k, tokens)
            rows = xs.shape[0]
            touched = int(jnp.sum(sizes > 0))
            nbytes = touched * 3 * hidden * inter * 2
            flops = 2 * rows * hidden * inter * 3
            ref = jax.jit(functools.partial(gm.moe_experts, impl="ragged"))(
                xs.astype(jnp.float32), tuple(w.astype(jnp.float32) for w in ws), sizes)
            ups, downs = SWEEP[phase] if sweep else ((), ())
            pairs = {"mosaic": tuple(config_fields(c) for c in gm.mosaic_configs(rows, e))}
            pairs.update({f"mosaic_{i}": p for i, p in enumerate(zip(ups, downs))})
            calls = {impl: (jax.jit(functools.partial(gm.moe_experts, impl=impl,
                                                      max_group_size=tokens)), (xs, ws, sizes))
                     for impl in baselines}
            calls.update({name: (mosaic_pair(*p), (xs, ws, sizes)) for name, p in pairs.items()})
            row: dict = {"rows": rows, "touched_experts": touched, "weight_bytes": nbytes,
                         "flops": flops, "errors": {}, "us": {}, "configs": pairs}
            refs = {name: ref for name in calls}
            if fp8:
                wq, sq, deq, f8_calls, f8_tilings = fp8_case(ws, tokens, phase, fp8_sweep, baselines)
                ref8 = jax.jit(functools.partial(gm.moe_experts, impl="ragged"))(
                    xs.astype(jnp.float32), deq, sizes)
                del deq
                calls.update({n: (f, (xs, wq, sq, sizes)) for n, f in f8_calls.items()})
                refs.update({n: ref8 for n in f8_calls})
                row["fp8_configs"] = f8_tilings
                row["fp8_weight_bytes"] = nbytes // 2
            ok = {}
            for name, (f, args) in calls.items():
                try:
                    row["errors"][name] = rel_err(f(*args), refs[name])
                    ok[name] = (f, args)
                except Exception as exc:  # a tiling that does not compile is a result, not a crash
                    row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            # The whole routed layer as the model runs it (sort, gather, the dispatched experts,
            # back to token order, weighted sum): its time past the experts' is routing overhead.
            ok["layer"] = (jax.jit(lambda x, c, p, ws: routed_experts(x, c, p, ws)),
                           (*layer_in, ws))
            times = bench_interleaved(ok, reps=5, inner=10)
            for name, (up, down) in pairs.items():  # each kernel alone: where the time goes
                if name in ok:
                    row.setdefault("parts_us", {})[name] = time_parts(xs, ws, sizes, up, down)
            if fp8 and "fp8_mosaic" in ok:
                up, down = (config_fields(c) for c in gm.mosaic_configs(rows, e))
                row.setdefault("parts_us", {})["fp8_mosaic"] = time_fp8_parts(
                    xs, wq, sq, sizes, up, down)
            for name, t in times.items():
                row["us"][name] = round(t * 1e6, 1)
            row["tbps"] = {n: round((nbytes // 2 if n.startswith("fp8") else nbytes) / t / 1e12, 3)
                           for n, t in times.items()}
            row["tfs"] = {n: round(flops / t / 1e12, 1) for n, t in times.items()}
            res[f"{model}_{phase}"] = row
            for key, pick in (("ours", "mosaic" if "mosaic" in times else None),
                              ("best", min((n for n in times if n.startswith("mosaic")),
                                           key=times.get, default=None))):
                if pick:
                    frac = (nbytes / times[pick] / 1e12 / res["hbm_read_tbps"] if phase == "decode"
                            else flops / times[pick] / 1e12 / res["matmul_tfs"])
                    res[f"{model}_{phase}_{key}"] = {"name": pick, "frac": round(frac, 3)}
            if "fp8_mosaic" in times:
                t8 = times["fp8_mosaic"]
                res[f"{model}_{phase}_fp8"] = {
                    "frac_of_hbm": round(nbytes / 2 / t8 / 1e12 / res["hbm_read_tbps"], 3),
                    "speedup_vs_bf16_mosaic": (round(times["mosaic"] / t8, 3)
                                               if "mosaic" in times else None)}
            print(f"{model} {phase}: rows {rows}, touched {touched}: " + ", ".join(
                f"{n} {row['us'][n]} us ({row['tbps'][n]} TB/s, {row['tfs'][n]} TF/s)"
                for n in times), flush=True)
            print(f"  errors: {row['errors']}", flush=True)
            save_part("kernels", res)
            del xs, ws, ref, refs, calls, ok, layer_in
            if fp8:
                del wq, sq, ref8
    return res


# ---- engine ------------------------------------------------------------------------------------
def engine_section(model_key: str, backend: str = "mosaic", prompts: int = 64,
                   layers: int | None = None, quantization: str | None = None, moe_impl="auto"):
    import numpy as np

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams

    name, config = ENGINE_MODELS[model_key]
    config = {**config, "num_hidden_layers": layers or config["num_hidden_layers"]}
    work = Path(tempfile.mkdtemp(prefix="moe-"))
    (work / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    args = EngineArgs(model=str(work), load_format="dummy", dtype="bfloat16", max_num_seqs=64,
                      max_num_batched_tokens=2048, max_model_len=1024,
                      gpu_memory_utilization=0.9, attention_backend=backend,
                      quantization=quantization, moe_impl=moe_impl,
                      background_compile=False)  # timed steps never run padded into a bigger bucket
    engine = LLMEngine.from_engine_args(args)
    ready_s = time.perf_counter() - t0  # weights made on device + every bucket compiled
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for i in range(prompts):
        engine.add_request(f"r{i}", rng.integers(0, config["vocab_size"], 512).tolist(), params)
    stamps, n_out = [], 0
    engine.stats.__init__()
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
            "sync_gap_ms": round(engine.stats.sync_gap_ms, 3), **mix,
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


# ---- driver ------------------------------------------------------------------------------------
def save_part(name: str, value) -> None:
    path = OUT / "moe_h200.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record.setdefault("parts", {})[name] = value
    path.write_text(json.dumps(record, indent=1))


def mosaic_passed(tolerance: float = 2e-2, prefix: str = "mosaic") -> bool:
    """Whether some tiling of our kernel (bf16; prefix "fp8_mosaic": its e4m3 path) matched the
    reference in every kernel case measured."""
    path = OUT / "moe_h200.json"
    kernels = json.loads(path.read_text()).get("parts", {}).get("kernels", {}) if path.exists() else {}
    rows = [r for r in kernels.values() if isinstance(r, dict) and "errors" in r]
    return bool(rows) and all(
        any(isinstance(v, float) and v < tolerance for n, v in r["errors"].items()
            if n.startswith(prefix)) for r in rows)


def metrics(parts: dict) -> dict:
    k = parts.get("kernels", {})
    q, m = parts.get("qwen", {}), parts.get("mixtral", {})
    out = {"hbm_read_tbps": k.get("hbm_read_tbps"), "matmul_tfs": k.get("matmul_tfs"),
           "qwen3_30b_a3b_c64_out_tok_s": q.get("out_tok_s"),
           "qwen3_30b_a3b_bs64_step_ms": q.get("decode_step_ms_median"),
           "mixtral_8x7b_c64_out_tok_s": m.get("out_tok_s"),
           "mixtral_8x7b_bs64_step_ms": m.get("decode_step_ms_median")}
    q8 = parts.get("qwen_fp8", {})
    if isinstance(q8, dict) and q8:
        out["qwen3_30b_a3b_fp8_c64_out_tok_s"] = q8.get("out_tok_s")
        out["qwen3_30b_a3b_fp8_bs64_step_ms"] = q8.get("decode_step_ms_median")
    for phase, key in (("decode", "gmm_decode_frac_of_hbm"), ("prefill", "gmm_prefill_frac_of_matmul")):
        ours = k.get(f"qwen3_30b_a3b_{phase}_ours") or k.get(f"qwen3_30b_a3b_{phase}_best")
        out[key] = ours and ours["frac"]
        f8 = k.get(f"qwen3_30b_a3b_{phase}_fp8")
        if f8:
            out[f"gmm_fp8_{phase}_frac_of_hbm"] = f8["frac_of_hbm"]
            out[f"gmm_fp8_{phase}_speedup_vs_bf16"] = f8["speedup_vs_bf16_mosaic"]
        for model in SHAPES:
            row = k.get(f"{model}_{phase}")
            if isinstance(row, dict):
                for impl, t in row["us"].items():
                    out[f"{model}_{phase}_{impl}_us"] = t
    return out


def summary_table(parts: dict) -> str:
    """Per kernel case: us (TB/s of its weight bytes) of the bf16 kernel and of each e4m3 variant,
    the kernels' errors; then the engine steps."""
    k = parts.get("kernels", {})
    lines = [f"HBM read ceiling {k.get('hbm_read_tbps', 0):.2f} TB/s",
             f"{'case':<24}{'impl':<16}{'us':>9}{'TB/s':>8}{'err':>10}"]
    for case, row in k.items():
        if not (isinstance(row, dict) and "us" in row):
            continue
        for name in [n for n in row["us"] if n == "mosaic" or n.startswith("fp8")]:
            err = row["errors"].get(name)
            lines.append(f"{case:<24}{name:<16}{row['us'][name]:>9.1f}{row['tbps'][name]:>8.2f}"
                         + (f"{err:>10.2e}" if isinstance(err, float) else f"{'-':>10}"))
    for name in ("qwen", "qwen_fp8"):
        e = parts.get(name)
        if isinstance(e, dict):
            lines.append(f"engine {name}: decode step {e.get('decode_step_ms_median')} ms, "
                         f"{e.get('out_tok_s')} tok/s, ready {e.get('ready_s')} s, "
                         f"moe_impl {e.get('moe_impl')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="kernels,qwen,mixtral")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    ap.add_argument("--models", default=",".join(SHAPES), help="kernels: the model shapes to time")
    ap.add_argument("--no-sweep", action="store_true",
                    help="kernels: only the tiling moe_experts picks, no SWEEP candidates")
    ap.add_argument("--layers", type=int, default=None,
                    help="engine: decoder layers (default: the model's; fewer for a quick step mix)")
    ap.add_argument("--phases", default=",".join(PHASE_TOKENS), help="kernels: phases to time")
    ap.add_argument("--baselines", default="ragged,padded",
                    help="kernels: XLA paths timed beside ours (comma list; empty for none)")
    ap.add_argument("--fp8", action="store_true",
                    help="kernels: the e4m3 experts too (our kernel's fp8 path, the XLA paths)")
    ap.add_argument("--no-fp8-sweep", action="store_true",
                    help="kernels: with --fp8, only the tiling moe_experts picks")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="engine: quantize the dummy weights (part qwen_fp8 / mixtral_fp8)")
    ap.add_argument("--moe-impl", default="auto", help="engine: the engine's --moe-impl")
    results_io.add_save_arg(ap, "moe_<gpu>")
    ap.add_argument("--from-parts", default=None,
                    help="write the record from a moe_h200.json of parts (from --run-section runs)")
    ap.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--section-s", type=float, default=200.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_section:
        if args.run_section == "kernels":
            value = kernel_section(args.section_s, args.models.split(","), not args.no_sweep,
                                   args.phases.split(","),
                                   tuple(b for b in args.baselines.split(",") if b),
                                   args.fp8, not args.no_fp8_sweep)
            name = "kernels"
        else:
            value = engine_section(args.run_section, layers=args.layers,
                                   quantization=args.quantization, moe_impl=args.moe_impl)
            name = args.run_section + (f"_{args.quantization}" if args.quantization else "")
        # A cut model's run is a step-mix probe, kept apart from the full model's figures.
        save_part(name + (f"_{args.layers}_layers" if args.layers else ""), value)
        print(json.dumps(value)[:4000], flush=True)
        return
    if args.from_parts:  # the record of parts saved by earlier --run-section calls
        save_record(json.loads(Path(args.from_parts).read_text())["parts"], args)
        return
    start = time.perf_counter()
    limits = {"kernels": 180, "qwen": 330, "mixtral": 360}
    moe_impl = args.moe_impl
    for name in args.sections.split(","):
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 60:
            save_part(name, "skipped: call deadline")
            continue
        limit = min(limits[name], left)
        argv = [sys.executable, __file__, "--run-section", name, "--section-s", str(limit - 60),
                "--models", args.models, "--phases", args.phases, "--baselines", args.baselines]
        argv += (["--layers", str(args.layers)] if args.layers else []) + (
            ["--no-sweep"] if args.no_sweep else []) + (["--fp8"] if args.fp8 else []) + (
            ["--no-fp8-sweep"] if args.no_fp8_sweep else []) + (
            ["--quantization", args.quantization] if args.quantization else []) + ["--moe-impl", moe_impl]
        try:
            proc = subprocess.run(argv, cwd=ROOT, timeout=limit, capture_output=True, text=True)
            print(proc.stdout[-6000:], flush=True)
            if proc.returncode:
                print(proc.stderr[-4000:], flush=True)
                save_part(f"{name}_error", proc.stderr[-3000:])
        except subprocess.TimeoutExpired as exc:
            print(f"[{name} timed out after {limit:.0f} s]", str(exc.stdout or "")[-3000:], flush=True)
            save_part(f"{name}_error", f"timed out after {limit:.0f} s")
        if name == "kernels" and not mosaic_passed():
            moe_impl = "padded"  # the engine figures then say which path ran
        if name == "kernels" and args.fp8 and args.quantization and not mosaic_passed(
                prefix="fp8_mosaic"):
            moe_impl = "xla"  # a wrong kernel is not timed in the engine
    save_record(json.loads((OUT / "moe_h200.json").read_text()).get("parts", {}), args)


def save_record(parts: dict, args) -> None:
    config = {"shapes": SHAPES, "phase_tokens": PHASE_TOKENS, "sweep": SWEEP,
              "fp8_sweep": FP8_SWEEP, "parts": parts,
              "engine_workload": "64 prompts x 512 in / 256 out, max 64 seqs, dummy bf16"}
    figures = metrics(parts)
    print(json.dumps(figures, indent=1))
    print(summary_table(parts), flush=True)
    if args.save:
        results_io.save(args.save, args.name or f"moe_{results_io.device_slug()}", config=config,
                        metrics=figures)


if __name__ == "__main__":
    main()
