"""The engine on the GPU, one device call: compile time and offline throughput at a real model size.

    PYTHONUNBUFFERED=1 python -m benchmarks.bench_engine_gpu [--sections ...]
        [--deadline-s 540] [--backend mosaic|triton|reference] [--save [DIR]]

Sections (each in its own process, so one that crashes or runs out of time keeps the others'
figures; they share one fresh persistent compilation cache, so later sections reuse what earlier
ones compiled):
  warmup      the bundled demo model (bf16) with the mosaic backend at the default buckets
              (256 sequences, 2048 tokens): total warm-up, the slowest shapes, and where the time
              goes (jaxpr tracing, lowering to MLIR — which includes lowering the Mosaic kernels — and
              XLA's backend compile), from jax's monitoring events. Cold cache.
  llama8b     Llama-3-8B-shaped model (random bf16 weights, `--load-format dummy`), mosaic backend:
              `jaxinfer bench throughput`, 64 prompts x 512 in / 256 out, max 64 sequences.
  demo        `jaxinfer bench throughput` on the demo model, 256 prompts x 256 in / 256 out.
Prints a short table last; `--save` writes the record engine_<gpu>.json (`results_io`) with
`warmup_s`, `<section>_output_tok_s` and `<section>_total_tok_s`. The greedy parity of the kernels'
backend with the reference one is tests/gpu/test_engine_parity_gpu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B

ROOT = Path(__file__).resolve().parent.parent

# The llama8b section's `jaxinfer bench throughput` workload (the llama8b preset's).
LLAMA8B_WORKLOAD = ["--load-format", "dummy", "--num-prompts", "64", "--input-len", "512",
                    "--output-len", "256", "--max-num-seqs", "64", "--max-num-batched-tokens",
                    "2048", "--max-model-len", "2048", "--gpu-memory-utilization", "0.85"]


# ---- sections that run inside a child process ------------------------------------------------
def section_warmup(cache_dir: str) -> dict:
    import jax

    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.engine.args import EngineArgs

    phases: dict[str, float] = {}

    def listen(event: str, duration_s: float, **_) -> None:
        for key in ("jaxpr_trace", "jaxpr_to_mlir_module", "backend_compile"):
            if key in event:
                phases[key] = phases.get(key, 0.0) + duration_s

    jax.monitoring.register_event_duration_secs_listener(listen)
    args = EngineArgs(attention_backend="mosaic", dtype="bfloat16", num_blocks=8192,
                      compilation_cache_dir=cache_dir, warmup=False)
    engine = LLMEngine.from_engine_args(args)
    total = engine.warmup()
    per_shape = engine.runner.warmup_seconds
    slowest = sorted(per_shape.items(), key=lambda kv: -kv[1])[:6]
    return dict(total_s=round(total, 1), shapes=len(per_shape),
                phases_s={k: round(v, 1) for k, v in phases.items()},
                slowest={k: round(v, 2) for k, v in slowest},
                per_shape={k: round(v, 2) for k, v in per_shape.items()})


def run_section(name: str, cache_dir: str) -> None:
    print(json.dumps(section_warmup(cache_dir)), flush=True)


# ---- the driver ------------------------------------------------------------------------------
def child(argv: list[str], timeout: float, grace_s: float = 15) -> tuple[str, str, int | None]:
    """Run a section; past `timeout` it gets SIGABRT first, so faulthandler (on in the child)
    prints every thread's Python stack into stderr — where a hung step waits is then on record;
    `grace_s` later it is killed."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return stdout, stderr, proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        stderr = "\n".join(l for l in stderr.splitlines() if "/s]" not in l)  # no progress bars
        return stdout, stderr + f"\n[timed out after {timeout:.0f} s]", None


def throughput_argv(model: str, extra: list[str], json_path: Path, cache_dir: str,
                    backend: str = "mosaic") -> list[str]:
    return [sys.executable, "-m", "jaxinfer.bench.cli", "throughput", "--model", model,
            "--attention-backend", backend, "--dtype", "bfloat16", "--temperature", "0",
            "--compilation-cache-dir", cache_dir, "--output-json", str(json_path), *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="warmup,llama8b,demo")
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--backend", default="mosaic",
                    help="attention backend of the throughput sections (llama8b, demo)")
    ap.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, "engine_<gpu>")
    args = ap.parse_args()
    if args.run_section:
        return run_section(args.run_section, args.cache_dir)

    start = time.perf_counter()
    cache_dir = tempfile.mkdtemp(prefix="jaxinfer-cc-")
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-gpu-"))
    llama_dir = work / "llama3-8b-shape"
    llama_dir.mkdir()
    (llama_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    plans = {
        "warmup": ([sys.executable, "-m", __spec__.name, "--run-section", "warmup",
                    "--cache-dir", cache_dir], 240),
        "llama8b": (throughput_argv(str(llama_dir), LLAMA8B_WORKLOAD, work / "llama8b.json",
                                    cache_dir, args.backend), 300),
        "demo": (throughput_argv(str(ROOT / "checkpoints" / "demo-target"), [
            "--num-prompts", "256", "--input-len", "256", "--output-len", "256",
            "--num-blocks", "16384"], work / "demo.json", cache_dir, args.backend), 150),
    }
    results: dict = {}
    for name in args.sections.split(","):
        argv, limit = plans[name]
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 30:
            results[name] = "skipped: call deadline"
            continue
        t0 = time.perf_counter()
        stdout, stderr, rc = child(argv, min(limit, left))
        entry: dict = {"wall_s": round(time.perf_counter() - t0, 1), "rc": rc}
        json_file = work / f"{name}.json"
        if json_file.exists():
            entry["result"] = json.loads(json_file.read_text())
        elif rc == 0 and stdout.strip():
            entry["result"] = json.loads(stdout.strip().splitlines()[-1])
        if rc != 0:
            entry["stderr_tail"] = stderr[-3000:]
        entry["log_tail"] = [l for l in (stdout + stderr).splitlines()
                             if "compiled" in l or "Throughput" in l or "KV cache" in l][-6:]
        results[name] = entry
        print(f"== {name}: {json.dumps(entry)[:3000]}", flush=True)
    print_table(results)
    if args.save:
        # device_slug imports jax only now: the sections' processes had the GPU to themselves.
        results_io.save(args.save, args.name or f"engine_{results_io.device_slug()}",
                        metrics=metrics(results),
                        config={"sections": args.sections, "backend": args.backend,
                                "llama8b_workload": " ".join(LLAMA8B_WORKLOAD)})


def metrics(results: dict) -> dict:
    out = {}
    for name, entry in results.items():
        r = entry.get("result") if isinstance(entry, dict) else None
        if not r:
            out[f"{name}_error"] = str(entry)[:200]
        elif name == "warmup":
            out.update(warmup_s=r["total_s"], warmup_shapes=r["shapes"])
        else:
            out.update({f"{name}_output_tok_s": round(r["output_tokens_per_second"], 1),
                        f"{name}_total_tok_s": round(r["tokens_per_second"], 1),
                        f"{name}_host_ms_per_step": round(r["host_ms_per_step"], 3)})
    return out


def print_table(results: dict) -> None:
    print("\nsection   | figure")
    w = results.get("warmup", {}).get("result")
    if w:
        print(f"warmup    | {w['shapes']} shapes in {w['total_s']} s; phases {w['phases_s']}; "
              f"slowest {w['slowest']}")
    for name in ("llama8b", "demo"):
        r = results.get(name, {}).get("result")
        if r:
            print(f"{name:9} | {r['requests_per_second']:.2f} req/s, {r['output_tokens_per_second']:.0f} "
                  f"output tok/s, {r['tokens_per_second']:.0f} total tok/s, {r['steps']} steps, "
                  f"host {r['host_ms_per_step']:.2f} ms/step")
        elif name in results:
            print(f"{name:9} | no result: {str(results[name])[:300]}")


if __name__ == "__main__":
    main()
