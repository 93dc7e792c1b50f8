"""The first minute after a warm start (issue 38), and the FP8 c = 256 figure with fresh prompts.

    jaxinfer bench startup --suite first-minute -- [--save [DIR]] [--deadline-s 470]
    JAX_PLATFORMS=cpu jaxinfer bench startup --suite first-minute -- --tiny   # CPU check of the script

Llama-3-8B shape, dummy weights, FP8 weights + FP8 KV cache (`--quantization fp8
--kv-cache-dtype fp8`), 256 sequences, 2048-token steps, max_model_len 1024, mosaic attention.
Two processes over one new compilation cache directory:
  cold  `jaxinfer warmup` with the engine's flags: every step bucket compiled into the cache
        (`cold_warmup_s`, the whole command).
  warm  the engine as `jaxinfer serve` builds it (background compilation on), then, from ready:
        - `ready_s` and `buckets_compiling_at_ready` (0 when the cold process filled the cache);
        - the first request (one random 512-token prompt, 32 tokens) against the median of three
          more (`first_request_s`, `steady_request_s`, `first_over_steady`; goal <= 2);
        - c = 256 for 30 s (a closed loop: each finished request replaced by a new random 512 in /
          256 out one; output tokens that reached the host in the window): `first30_out_tok_s`;
          then, every bucket surely compiled (`compiler.wait()`), the same 30 s again:
          `compiled30_out_tok_s`, and `first30_over_compiled` (goal >= 0.9);
        - `llama8b_fp8w_fp8kv_c256_out_tok_s`: 256 random 512 in / 256 out all at once, after an
          untimed run of other prompts (suites.multi_gpu._throughput), with its window's
          `_prefix_hit_rate` (0: the timed prompts are new) and `_buckets_compiling`.
Every timed prompt is new to the prefix cache. Expected time on one H200: cold about 4.5 min
(quant_h200's llama8b_fp8w_fp8kv_ready_s, 276 s, compiled every bucket), warm about 2 min.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.common import child, cli_module
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.bench.timed_window import buckets_compiling, fresh_prompts

IN_LEN, OUT_LEN, CONCURRENCY, WINDOW_S = 512, 256, 256, 30.0
TINY_SHAPES = dict(in_len=32, out_len=16, concurrency=8, window_s=4.0)


def engine_flags(model_dir: str, cache_dir: str, tiny: bool) -> list[str]:
    """The engine's command-line flags: the cold `jaxinfer warmup` and the warm engine parse the
    same ones, so the warm start's cache keys are the cold one's."""
    seqs = 8 if tiny else CONCURRENCY
    blocks = seqs * -(-(IN_LEN + OUT_LEN + 16) // 16) + 64
    return ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16",
            "--quantization", "fp8", "--kv-cache-dtype", "fp8",
            "--attention-backend", "reference" if tiny else "mosaic",
            "--max-num-seqs", str(seqs), "--max-num-batched-tokens", "64" if tiny else "2048",
            "--max-model-len", "1024", "--num-blocks", str(blocks),
            "--compilation-cache-dir", cache_dir]


def closed_loop(engine, vocab: int, shapes: dict, seed: int) -> float:
    """Output tok/s of `concurrency` requests in flight for `window_s` seconds, each finished one
    replaced by a new one (fresh prompts); what is in flight at the end is aborted."""
    from jaxinfer.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=shapes["out_len"], ignore_eos=True)
    prompts = iter(fresh_prompts(vocab, 100_000, shapes["in_len"], seed=seed))
    active: set[str] = set()
    n = tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < shapes["window_s"]:
        while len(active) < shapes["concurrency"]:
            rid = f"loop{seed}-{n}"
            engine.add_request(rid, next(prompts), params)
            active.add(rid)
            n += 1
        for out in engine.step():
            tokens += sum(len(c.new_token_ids) for c in out.outputs)
            if out.finished:
                active.discard(out.request_id)
    elapsed = time.perf_counter() - t0
    for rid in active:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / elapsed


def run_warm(cfg: dict) -> dict:
    from jaxinfer.bench.suites.multi_gpu import _throughput
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.frontends.llm import LLM
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams

    shapes = TINY_SHAPES if cfg["tiny"] else dict(in_len=IN_LEN, out_len=OUT_LEN,
                                                   concurrency=CONCURRENCY, window_s=WINDOW_S)
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(p.parse_args(cfg["flags"])))
    out = {"ready_s": round(time.perf_counter() - t0, 1),
           "buckets_compiling_at_ready": buckets_compiling(engine)}
    print(json.dumps(out), flush=True)
    llm = LLM(engine=engine)
    vocab = engine.cfg.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    times = []
    for i, prompt in enumerate(fresh_prompts(vocab, 4, shapes["in_len"], seed=10)):
        start = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    steady = statistics.median(times[1:])
    out.update(first_request_s=round(times[0], 3), steady_request_s=round(steady, 3),
               first_over_steady=round(times[0] / steady, 2))
    out["first30_buckets_compiling"] = buckets_compiling(engine)
    out["first30_out_tok_s"] = round(closed_loop(engine, vocab, shapes, seed=11), 1)
    print(json.dumps(out), flush=True)
    wait_t0 = time.perf_counter()
    engine.runner.compiler.wait()
    out["compile_wait_s"] = round(time.perf_counter() - wait_t0, 1)
    out["compiled30_out_tok_s"] = round(closed_loop(engine, vocab, shapes, seed=12), 1)
    out["first30_over_compiled"] = round(out["first30_out_tok_s"] / out["compiled30_out_tok_s"], 3)
    print(json.dumps(out), flush=True)
    out.update(_throughput(llm, shapes["concurrency"], 32, "llama8b_fp8w_fp8kv_c256",
                           in_len=shapes["in_len"], out_len=shapes["out_len"]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, c = 8, 4 s windows")
    ap.add_argument("--deadline-s", type=float, default=470.0)
    ap.add_argument("--run-warm", default=None, help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, "first_minute_<gpu>")
    args = ap.parse_args(argv)
    if args.run_warm:
        print("RESULT " + json.dumps(run_warm(json.loads(args.run_warm))), flush=True)
        return
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-first-minute-"))
    (work / "model").mkdir()
    if args.tiny:
        from jaxinfer.bench.suites.bs1_step import TINY
    (work / "model" / "config.json").write_text(json.dumps(TINY if args.tiny else LLAMA3_8B))
    flags = engine_flags(str(work / "model"), str(work / "cc"), args.tiny)
    metrics: dict = {}
    phases: dict = {}
    t0 = time.perf_counter()
    stdout, stderr, rc = child([sys.executable, "-m", cli_module(), "warmup", *flags],
                               args.deadline_s - 150)
    phases["cold"] = {"wall_s": round(time.perf_counter() - t0, 1), "rc": rc,
                      "stdout_tail": stdout[-300:]}
    if rc != 0:
        phases["cold"]["stderr_tail"] = stderr[-2000:]
    metrics["cold_warmup_s"] = round(time.perf_counter() - t0, 1)
    print(f"== cold: {json.dumps(phases['cold'])}", flush=True)
    t0 = time.perf_counter()
    left = args.deadline_s - (time.perf_counter() - start)
    stdout, stderr, rc = child([sys.executable, "-m", __spec__.name, "--run-warm",
                                json.dumps({"flags": flags, "tiny": args.tiny})], left)
    got = {}
    for line in stdout.splitlines():  # the last figures printed, kept if the phase timed out
        if line.startswith("{") or line.startswith("RESULT "):
            got = json.loads(line.removeprefix("RESULT "))
    metrics.update(got)
    phases["warm"] = {"wall_s": round(time.perf_counter() - t0, 1), "rc": rc}
    if rc != 0:
        phases["warm"]["stderr_tail"] = stderr[-2000:]
    print(f"== warm: {json.dumps(phases['warm'])}", flush=True)
    print("\n".join(f"{k} | {v}" for k, v in metrics.items()))
    if args.save:
        # (not results_io.device_slug(): jax in this process would take the GPU's memory)
        results_io.save(args.save, args.name or ("first_minute_cpu" if args.tiny
                                                 else "first_minute_h200"),
                        metrics=metrics, config={
                            "model": "Llama-3-8B shape, dummy weights" if not args.tiny else "tiny",
                            "engine_flags": flags[2:], "phases": phases,
                            "workload": "c = 256 closed loop of random 512 in / 256 out, 30 s "
                                        "windows; first/steady request: 512 in / 32 out"})


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
