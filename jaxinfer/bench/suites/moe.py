"""Routed experts on the GPU, one device call: the grouped-matmul kernel beside `ragged_dot` and the
padded einsum, against ceilings measured in the same run; then the engine end to end on MoE shapes.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite moe -- [--sections kernels,routing,qwen,mixtral]
        [--deadline-s 560] [--fp8] [--quantization fp8] [--save [DIR]] [--merge RECORD.json]
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite moe -- --fp8 \
        --quantization fp8 --sections kernels,qwen         # CPU smoke run: tiny shapes

Sections (each in its own process, time-limited; figures are saved after every part):
  kernels  ceilings (jaxinfer.bench.anchors: the best plain read of 8 GiB and bf16 matmul, named),
           then per model shape (Qwen3-30B-A3B:
           128 experts, hidden 2048, expert inter 768, top-8; Mixtral-8x7B: 8 experts, 4096,
           14336, top-2) and phase (decode: 64 tokens; prefill: 2048 tokens), with routing from a
           random router: correctness of every implementation against float32 `ragged_dot`, then
           the time of the whole expert MLP (gate, up, down) per implementation and of our kernel's
           two calls per tiling (`mosaic`: the tiling `moe_experts` picks; `mosaic_i`: SWEEP's),
           and the share of the rows its wgmmas compute that are real (`real_row_frac`).
           TB/s counts the touched experts' weight bytes once; TF/s 2 * rows * hidden * inter * 3.
           `--fp8`: beside them the same experts quantized to e4m3 (per-expert channel scales, as
           `--quantization fp8` stores them): our kernel's fp8 path (`fp8_mosaic`: the tiling
           `moe_experts` picks; `fp8_mosaic_i`: FP8_SWEEP's) and the XLA paths quantized experts
           run without it (`fp8_padded`, `fp8_ragged`), checked against float32 `ragged_dot` on the
           dequantized weights; their TB/s counts the e4m3 bytes. A table of both closes the run.
  routing  one MoE layer's router + dispatch, the fused Pallas kernel against `route` and the sort
           (moe_routing.py), on the Qwen3-30B-A3B and DeepSeek-V2-Lite shapes at 1, 8, 64, 256 and
           2048 tokens and DeepSeek-V3's (256 experts, sigmoid + bias, groups) at 1, 8 and 64:
           microseconds each, whether both dispatches are identical.
  qwen     the engine on the Qwen3-30B-A3B shape (dummy bf16), 64 prompts x 512 in / 256 out,
           --max-num-seqs 64: output tok/s and the median step while all 64 decode.
           `--quantization fp8`: every linear and expert e4m3 (experts on the kernel unless
           `--moe-impl xla`, or its check failed in `kernels`), saved as part `qwen_fp8`.
  mixtral  the same on the Mixtral-8x7B shape.
The kernel section is moe_kernels.py, the routing section moe_routing.py, the engine's
moe_engine.py (beside this module), each run in its own process. Parts go to
$OUT/moe_parts.json as they finish; `--save` writes the record moe_<gpu>.json (`--merge`: folded
into a stored record, its other keys kept). BENCH_TINY_SHAPES=1: tiny shapes (moe_kernels.py,
moe_routing.py, moe_engine.py), no Mosaic kernel timed, the routing kernel interpreted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.suites.moe_engine import engine_section
from jaxinfer.bench.suites.moe_kernels import FP8_SWEEP, PHASE_TOKENS, SHAPES, SWEEP, kernel_section
from jaxinfer.bench.suites.moe_routing import ROUTING_SHAPES, ROUTING_TOKENS, routing_section
from jaxinfer.paths import REPO_ROOT

OUT = Path(os.environ.get("OUT", "/tmp"))
PARTS = OUT / "moe_parts.json"  # not the record's name: `--save $OUT` must not overwrite it


# ---- driver ------------------------------------------------------------------------------------
def save_part(name: str, value) -> None:
    path = PARTS
    record = json.loads(path.read_text()) if path.exists() else {}
    record.setdefault("parts", {})[name] = value
    path.write_text(json.dumps(record, indent=1))


def mosaic_passed(tolerance: float = 2e-2, prefix: str = "mosaic") -> bool:
    """Whether some tiling of our kernel (bf16; prefix "fp8_mosaic": its e4m3 path) matched the
    reference in every kernel case measured."""
    path = PARTS
    kernels = json.loads(path.read_text()).get("parts", {}).get("kernels", {}) if path.exists() else {}
    rows = [r for r in kernels.values() if isinstance(r, dict) and "errors" in r]
    return bool(rows) and all(
        any(isinstance(v, float) and v < tolerance for n, v in r["errors"].items()
            if n.startswith(prefix)) for r in rows)


def metrics(parts: dict) -> dict:
    k = parts.get("kernels", {})
    q, m = parts.get("qwen", {}), parts.get("mixtral", {})
    out = {"hbm_read_tbps": k.get("hbm_read_tbps"), "matmul_tfs": k.get("matmul_tfs"),
           "read_kernel": k.get("read_kernel"), "matmul_shape": k.get("matmul_shape"),
           "qwen3_30b_a3b_c64_out_tok_s": q.get("out_tok_s"),
           "qwen3_30b_a3b_bs64_step_ms": q.get("decode_step_ms_median"),
           "mixtral_8x7b_c64_out_tok_s": m.get("out_tok_s"),
           "mixtral_8x7b_bs64_step_ms": m.get("decode_step_ms_median"),
           "qwen3_30b_a3b_c64_prefix_hit_rate": q.get("prefix_hit_rate")}
    q8 = parts.get("qwen_fp8", {})
    if isinstance(q8, dict) and q8:
        out["qwen3_30b_a3b_fp8_c64_out_tok_s"] = q8.get("out_tok_s")
        out["qwen3_30b_a3b_fp8_bs64_step_ms"] = q8.get("decode_step_ms_median")
        out["qwen3_30b_a3b_fp8_c64_prefix_hit_rate"] = q8.get("prefix_hit_rate")
    for phase, key in (("decode", "gmm_decode_frac_of_hbm"), ("prefill", "gmm_prefill_frac_of_matmul")):
        ours = k.get(f"qwen3_30b_a3b_{phase}_ours") or k.get(f"qwen3_30b_a3b_{phase}_best")
        out[key] = ours and ours["frac"]
        best = k.get(f"qwen3_30b_a3b_{phase}_best")
        if best:  # the fastest tiling timed, which may not be the dispatched one
            out[f"gmm_{phase}_best_tiling"] = best["name"]
            out[f"gmm_{phase}_best_frac"] = best["frac"]
        case = k.get(f"qwen3_30b_a3b_{phase}")
        if isinstance(case, dict) and "real_row_frac" in case:
            for call, frac in case["real_row_frac"].items():
                out[f"gmm_{phase}_{call}_real_row_frac"] = frac
        f8 = k.get(f"qwen3_30b_a3b_{phase}_fp8")
        if f8:
            out[f"gmm_fp8_{phase}_frac_of_hbm"] = f8["frac_of_hbm"]
            out[f"gmm_fp8_{phase}_speedup_vs_bf16"] = f8["speedup_vs_bf16_mosaic"]
        for model in SHAPES:
            row = k.get(f"{model}_{phase}")
            if isinstance(row, dict):
                for impl, t in row["us"].items():
                    out[f"{model}_{phase}_{impl}_us"] = t
    for case, row in (parts.get("routing") or {}).items():
        if isinstance(row, dict) and "fused_us" in row:
            out[f"routing_{case}_fused_us"] = row["fused_us"]
            out[f"routing_{case}_unfused_us"] = row["unfused_us"]
            out[f"routing_{case}_fused_speedup"] = row["speedup"]
            out[f"routing_{case}_dispatch_identical"] = row["dispatch_identical"]
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


def main(argv: list[str] | None = None) -> None:
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
    results_io.add_merge_arg(ap)
    ap.add_argument("--from-parts", default=None,
                    help="write the record from a moe_parts.json (from --run-section runs)")
    ap.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--section-s", type=float, default=200.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_section:
        if args.run_section == "kernels":
            value = kernel_section(args.section_s, args.models.split(","), not args.no_sweep,
                                   args.phases.split(","),
                                   tuple(b for b in args.baselines.split(",") if b),
                                   args.fp8, not args.no_fp8_sweep,
                                   save=lambda res: save_part("kernels", res))
            name = "kernels"
        elif args.run_section == "routing":
            value = routing_section(args.section_s, save=lambda res: save_part("routing", res))
            name = "routing"
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
    limits = {"kernels": 180, "routing": 180, "qwen": 330, "mixtral": 360}
    moe_impl = args.moe_impl
    for name in args.sections.split(","):
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 60:
            save_part(name, "skipped: call deadline")
            continue
        limit = min(limits[name], left)
        cmd = [sys.executable, "-m", __spec__.name, "--run-section", name, "--section-s", str(limit - 60),
               "--models", args.models, "--phases", args.phases, "--baselines", args.baselines]
        cmd += (["--layers", str(args.layers)] if args.layers else []) + (
            ["--no-sweep"] if args.no_sweep else []) + (["--fp8"] if args.fp8 else []) + (
            ["--no-fp8-sweep"] if args.no_fp8_sweep else []) + (
            ["--quantization", args.quantization] if args.quantization else []) + [
            "--moe-impl", moe_impl]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, timeout=limit, capture_output=True, text=True)
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
    save_record(json.loads(PARTS.read_text()).get("parts", {}), args)


def save_record(parts: dict, args) -> None:
    config = {"shapes": SHAPES, "phase_tokens": PHASE_TOKENS, "sweep": SWEEP,
              "fp8_sweep": FP8_SWEEP, "routing_shapes": ROUTING_SHAPES,
              "routing_tokens": ROUTING_TOKENS, "parts": parts,
              "engine_workload": "64 prompts x 512 in / 256 out, max 64 seqs, dummy bf16"}
    figures = metrics(parts)
    print(json.dumps(figures, indent=1))
    print(summary_table(parts), flush=True)
    if args.save:
        results_io.save(args.save, args.name or f"moe_{results_io.device_slug()}", config=config,
                        metrics={k: v for k, v in figures.items() if v is not None},
                        merge=args.merge)


if __name__ == "__main__":
    main()
