"""The engine on the GPU, one device call: compile time, greedy parity between attention backends,
and offline throughput at a real model size.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_engine_check.py [--sections ...]
        [--deadline-s 540] [--backend mosaic|triton|reference]

Sections (each in its own process, so one that crashes or runs out of time keeps the others'
figures; they share one fresh persistent compilation cache, so later sections reuse what earlier
ones compiled):
  warmup      the bundled demo model (bf16) with the mosaic backend at the default buckets
              (256 sequences, 2048 tokens): total warm-up, the slowest shapes, and where the time
              goes (jaxpr tracing, lowering to MLIR — which includes lowering the Mosaic kernels — and
              XLA's backend compile), from jax's monitoring events. Cold cache.
  parity      the demo model greedily continues 16 held-out code prompts (48 tokens) with the
              `reference` backend and with `mosaic`; how many continuations are token-identical and,
              for the others, where they first differ and the reference's top-1/top-2 logit gap there
              (bf16 kernels round q and P, so a near-tie can flip a token).
  llama8b     Llama-3-8B-shaped model (random bf16 weights, `--load-format dummy`), mosaic backend:
              bench_throughput.py, 64 prompts x 512 in / 256 out, max 64 sequences.
  demo        bench_throughput.py on the demo model, 256 prompts x 256 in / 256 out.
Writes $OUT/gpu_engine_check.json; prints a short table last.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "/tmp"))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}

# The llama8b section's bench_throughput workload (gpu_engine_bisect.py runs the same one).
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


def section_parity(cache_dir: str) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.engine.llm_engine import LLM
    from jaxinfer.model.transformer import train_forward
    from jaxinfer.sampling_params import SamplingParams

    text = (ROOT / "checkpoints" / "heldout_sample.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    prompts = ["\n".join(lines[i:i + 3]) for i in range(0, 48, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens, seconds, llms = {}, {}, {}
    for backend in ("reference", "mosaic"):
        t0 = time.perf_counter()
        llm = LLM(attention_backend=backend, dtype="bfloat16", max_num_seqs=16,
                  max_num_batched_tokens=512, warmup=False, num_blocks=4096,
                  compilation_cache_dir=cache_dir)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
        seconds[backend] = round(time.perf_counter() - t0, 1)
        llms[backend] = llm
    engine = llms["reference"].engine
    firsts, gaps = [], []
    for (prompt, ref), (_, got) in zip(tokens["reference"], tokens["mosaic"]):
        first = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
        firsts.append(first)
        if first is not None:  # the reference's own top-1/top-2 gap where the two first differ
            ctx = list(prompt) + list(ref[:first])
            logits = np.asarray(train_forward(engine.runner.params, engine.cfg,
                                              jnp.asarray([ctx], jnp.int32))[0, -1], np.float32)
            top2 = np.sort(logits)[-2:]
            gaps.append(round(float(top2[1] - top2[0]), 4))
    same = sum(f is None for f in firsts)
    return dict(identical=same, of=len(firsts), first_difference_at=firsts,
                reference_top2_gap_at_difference=gaps, seconds=seconds)


def run_section(name: str, cache_dir: str) -> None:
    fn = {"warmup": section_warmup, "parity": section_parity}[name]
    print(json.dumps(fn(cache_dir)), flush=True)


# ---- the driver ------------------------------------------------------------------------------
def child(argv: list[str], timeout: float) -> tuple[str, str, int | None]:
    """Run a section; past `timeout` it gets SIGABRT first, so faulthandler (on in the child)
    prints every thread's Python stack into stderr — where a hung step waits is then on record."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return stdout, stderr, proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        stderr = "\n".join(l for l in stderr.splitlines() if "/s]" not in l)  # no progress bars
        return stdout, stderr + f"\n[timed out after {timeout:.0f} s]", None


def throughput_argv(model: str, extra: list[str], json_path: Path, cache_dir: str,
                    backend: str = "mosaic") -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "bench_throughput.py"), "--model", model,
            "--attention-backend", backend, "--dtype", "bfloat16", "--temperature", "0",
            "--compilation-cache-dir", cache_dir, "--output-json", str(json_path), *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="warmup,parity,llama8b,demo")
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--backend", default="mosaic",
                    help="attention backend of the throughput sections (llama8b, demo)")
    ap.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
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
        "warmup": ([sys.executable, __file__, "--run-section", "warmup", "--cache-dir", cache_dir], 240),
        "parity": ([sys.executable, __file__, "--run-section", "parity", "--cache-dir", cache_dir], 150),
        "llama8b": (throughput_argv(str(llama_dir), LLAMA8B_WORKLOAD, work / "llama8b.json",
                                    cache_dir, args.backend), 300),
        "demo": (throughput_argv(str(ROOT / "checkpoints" / "demo-target"), [
            "--num-prompts", "256", "--input-len", "256", "--output-len", "256",
            "--num-blocks", "16384"], work / "demo.json", cache_dir, args.backend), 150),
    }
    results: dict = {}
    dest = OUT / "gpu_engine_check.json"
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
        dest.write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    print("\nsection   | figure")
    w = results.get("warmup", {}).get("result")
    if w:
        print(f"warmup    | {w['shapes']} shapes in {w['total_s']} s; phases {w['phases_s']}; "
              f"slowest {w['slowest']}")
    p = results.get("parity", {}).get("result")
    if p:
        print(f"parity    | {p['identical']}/{p['of']} identical; first differences "
              f"{[f for f in p['first_difference_at'] if f is not None]}; ref top-2 gaps there "
              f"{p['reference_top2_gap_at_difference']}")
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
