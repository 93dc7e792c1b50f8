"""The engine at Llama-3-8B shape on one GPU, in one call: time to ready (cold and warm), batch-1
decode, concurrency 64 (inter-token latency) and 256 (throughput, host time), against rooflines
measured in the same run.

    PYTHONUNBUFFERED=1 jaxinfer bench latency --suite llama8b -- --save
        [--deadline-s 190] [--caps 256,0,512] [--num-blocks 16384]
    JAX_PLATFORMS=cpu jaxinfer bench latency --suite llama8b -- --tiny   # CPU check

Two engine processes share one fresh `--compilation-cache-dir`:
  cold  process start -> `LLMEngine.from_engine_args` returns (first buckets compiled, the rest
        compiling in the background): `time_to_ready_cold_s`; then `all_buckets_s` (the
        background compile done), and the workloads, each time-boxed:
        bs1   one request, 512 prompt / 256 output tokens, greedy, with the engine's default
              decode loop (8 steps per call at batch 1): `bs1_tpot_ms` (first to last
              token over 255 gaps), `bs1_out_tok_s` (256 over arrival to last token); measured
              once while the background compile still runs and again after it, then
              `bs1_profile` (profile/trace_engine_step.py): a decode step's kernels and idle time;
        roofline  the best plain HBM read rate and bf16 matmul rate (jaxinfer.bench.anchors: several
                  read kernels and product shapes, queued; the winners named) measured here, and
                  from them the batch-1 TPOT floor (weights + KV read per token) and the c256
                  output rate ceiling (prefill FLOPs + per-step weight and KV reads);
        c256  256 prompts at once (512 / 256): out tok/s, host ms per step, the prefill phase
              (until every prompt had its first token) and the decode step after it;
        c64   closed loop, 64 requests in flight (a new one as one finishes), 512-token prompts,
              128-384 output tokens: out tok/s, inter-token latency p50/p99 (each token's gap to
              the previous token of its request, as a streaming client sees it: the engine hands
              a step's tokens out at the next step), TTFT p99; once per `--caps` value of
              `--max-step-tokens-while-decoding` (0: the whole step budget); the `c64_*` keys
              are the fastest bounded run with ITL p99 <= 2.5 x p50 (`c64_headline`).
  warm  the same engine flags again: `time_to_ready_warm_s` (every executable loaded).
The driver never imports jax (the GPU stays the children's); each child prints `RESULT {json}`
lines, and `--save` rewrites engine_llama8b_<gpu>.json after every one, so a run cut short keeps
what it measured. `--tiny`: the demo model at small sizes (script check on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.bench.timed_window import TimedWindow
from jaxinfer.paths import REPO_ROOT


RESULT = "RESULT "
READY = "READY"


# ---- the engine process -----------------------------------------------------------------------
def emit(**metrics) -> None:
    print(RESULT + json.dumps(metrics), flush=True)


def engine_args(opts: dict):
    from jaxinfer.engine.args import EngineArgs
    return EngineArgs(**opts)


def token_times(engine, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Run `requests` (prompt ids, output tokens) greedily, `concurrency` in flight at a time;
    per request: when it was added and when each of its tokens reached the host."""
    from jaxinfer.sampling_params import SamplingParams
    pending = list(enumerate(requests))
    added: dict[str, float] = {}
    arrivals: dict[str, list[float]] = {}
    in_flight = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, (prompt, n) = pending.pop(0)
            rid = f"q{i}"
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                           ignore_eos=True))
            added[rid] = time.perf_counter()
            arrivals[rid] = []
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            arrivals[o.request_id] += [now] * len(o.outputs[0].new_token_ids)
            in_flight -= o.finished
    return {"added": added, "arrivals": arrivals}


def latency_figures(run: dict, elapsed: float) -> dict:
    itl, ttft, n_out = [], [], 0
    for rid, times in run["arrivals"].items():
        n_out += len(times)
        ttft.append(times[0] - run["added"][rid])
        itl += [b - a for a, b in zip(times, times[1:])]
    itl.sort()
    ttft.sort()

    def pct(xs, q):
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]
    return dict(out_tok_s=round(n_out / elapsed, 1), itl_p50_ms=round(pct(itl, 0.5), 2),
                itl_p99_ms=round(pct(itl, 0.99), 2), ttft_p50_ms=round(pct(ttft, 0.5), 1),
                ttft_p99_ms=round(pct(ttft, 0.99), 1))


def c64_headline(runs: dict[int, dict]) -> dict:
    """The c64_* keys: of the bounded runs, the fastest whose ITL p99 is within 2.5x its median
    (else the smoothest), with its bound and its throughput over the unbounded run's."""
    def ratio(f):
        return f["itl_p99_ms"] / f["itl_p50_ms"]
    bounded = {c: f for c, f in runs.items() if c} or runs
    smooth = {c: f for c, f in bounded.items() if ratio(f) <= 2.5}
    cap = (max(smooth, key=lambda c: smooth[c]["out_tok_s"]) if smooth
           else min(bounded, key=lambda c: ratio(bounded[c])))
    f = runs[cap]
    out = {f"c64_{k}": v for k, v in f.items()}
    out.update(c64_step_token_bound=cap or None, c64_itl_p99_over_p50=round(ratio(f), 2))
    if 0 in runs:
        out["c64_out_tok_s_over_unbounded"] = round(f["out_tok_s"] / runs[0]["out_tok_s"], 3)
    return out


def bs1(engine, prompt: list[int], out_len: int) -> dict:
    t0 = time.perf_counter()
    run = token_times(engine, [(prompt, out_len)], 1)
    times = run["arrivals"]["q0"]
    return dict(tpot_ms=round(1e3 * (times[-1] - times[0]) / (len(times) - 1), 3),
                out_tok_s=round(len(times) / (times[-1] - t0), 1))


def c256_phases(run: dict, t0: float, label: str) -> dict:
    """Where a c256 run's time went: until every prompt had its first token (the prefill phase,
    decode rows riding along), and the decode steps after it (inter-token gaps of every request
    from then on; the median is the decode step's period)."""
    firsts = [times[0] for times in run["arrivals"].values() if times]
    prefill_end = max(firsts)
    gaps = sorted(b - a for times in run["arrivals"].values()
                  for a, b in zip(times, times[1:]) if a >= prefill_end)
    return {f"{label}_prefill_phase_s": round(prefill_end - t0, 3),
            f"{label}_decode_step_ms_p50": round(1e3 * gaps[len(gaps) // 2], 3) if gaps else None}


def measure_rooflines(weight_bytes: int) -> dict:
    """The best plain read rate and bf16 matmul rate of jaxinfer.bench.anchors, measured now (2 GiB
    reads: the engine's pool holds most of the memory)."""
    from jaxinfer.bench import anchors
    m = anchors.measure(read_bytes=2 << 30)
    return dict(hbm_bytes_s=m["read_tbps"] * 1e12, matmul_flop_s=m["matmul_tflops"] * 1e12,
                weight_bytes=weight_bytes, read_kernel=m["read_kernel"],
                read_tbps_by_kernel=m["read_tbps_by_kernel"], matmul_shape=m["matmul_shape"])


def roofline_figures(r: dict, cfg, prompt_len: int, out_len: int, seqs: int) -> dict:
    """Floors and ceilings of the measured workloads from the measured rates."""
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
    mean_ctx = prompt_len + out_len / 2
    bs1_bytes = r["weight_bytes"] + mean_ctx * kv_token
    n_params = r["weight_bytes"] / 2
    step_s = (r["weight_bytes"] + seqs * mean_ctx * kv_token) / r["hbm_bytes_s"]
    prefill_s = 2 * n_params * prompt_len * seqs / r["matmul_flop_s"]
    return dict(roofline_hbm_tb_s=round(r["hbm_bytes_s"] / 1e12, 3),
                roofline_read_kernel=r.get("read_kernel"),
                roofline_read_tbps_by_kernel=r.get("read_tbps_by_kernel"),
                roofline_matmul_tflop_s=round(r["matmul_flop_s"] / 1e12, 1),
                roofline_weight_gb=round(r["weight_bytes"] / 1e9, 3),
                roofline_bs1_tpot_ms=round(1e3 * bs1_bytes / r["hbm_bytes_s"], 3),
                roofline_c256_out_tok_s=round(seqs * out_len / (prefill_s + out_len * step_s), 1))


def c256_buckets_then_stop(compiler, timeout: float) -> dict:
    """Wait for the units a c256 run steps in (the largest mixed bucket, every decode bucket and
    decode loop), then stop compiling the rest, so the measurements run beside no compile (XLA's
    threads and the tracing's GIL slow the step loop): the smaller mixed buckets' steps run
    padded to the largest one."""
    b = compiler.runner.buckets
    loops = set(compiler.runner.loop_buckets)
    need = {(s, s, s) for s in b.decode_buckets}
    end = time.perf_counter() + timeout
    while time.perf_counter() < end and not (need <= compiler.ready_forwards
                                              and loops <= compiler.ready_loops):
        time.sleep(0.2)
    ready = compiler.num_ready
    compiler.stop()
    return dict(buckets_ready=ready, c256_buckets_ready=need <= compiler.ready_forwards
                and loops <= compiler.ready_loops)


def engine_process(opts: dict, mode: str, tiny: bool, caps: list[int], left_s: float,
                   parts: set[str], runs: list[str]) -> None:
    start = time.perf_counter()
    import jax
    import numpy as np

    from jaxinfer.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_engine_args(engine_args(opts))
    print(READY, flush=True)
    dev = jax.devices()[0]
    emit(**{f"{mode}_startup_phases_s": engine.startup.as_dict(),
            "machine": dict(platform=dev.platform, device=getattr(dev, "device_kind", str(dev)),
                            device_count=jax.device_count(), jax=jax.__version__)})
    compiler = engine.runner.compiler
    emit(**{f"{mode}_buckets_ready_at_start": compiler.num_ready,
            "buckets_total": compiler.num_units})
    if mode == "warm":
        return
    deadline = start + left_s
    prompt_len, out_len = (32, 16) if tiny else (512, 256)
    rng = np.random.default_rng(0)
    vocab = engine.cfg.vocab_size

    def prompts(n):
        return [rng.integers(3, vocab, prompt_len).tolist() for _ in range(n)]

    if "bs1" in parts:
        r = bs1(engine, prompts(1)[0], out_len)
        emit(bs1_tpot_during_compile_ms=r["tpot_ms"], bs1_out_tok_s_during_compile=r["out_tok_s"])
    wait_s = max(1.0, deadline - time.perf_counter() - (45 if "bs1" in parts else 30))
    if "bs1" in parts:
        compiler.wait(timeout=wait_s)
        emit(all_buckets_s=round(time.perf_counter() - start, 2), buckets_ready=compiler.num_ready)
    else:
        emit(**c256_buckets_then_stop(compiler, wait_s), buckets_ready_s=round(
            time.perf_counter() - start, 2))
    compiles = [0]  # XLA compilations from here on: a step that waited for one shows here
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.__setitem__(0, compiles[0] + (
            event == "/jax/core/compile/backend_compile_duration")))
    if "bs1" in parts:
        bs1(engine, prompts(1)[0], 8)  # the now-ready decode buckets' first call
        runs = [bs1(engine, prompts(1)[0], out_len) for _ in range(2)]
        best = min(runs, key=lambda x: x["tpot_ms"])
        emit(bs1_tpot_ms=best["tpot_ms"], bs1_out_tok_s=best["out_tok_s"],
             bs1_tpot_runs_ms=[x["tpot_ms"] for x in runs])
    # After the timed runs: a traced process may keep some of the tracer's cost.
    if not tiny and "bs1" in parts:
        from jaxinfer.bench.profile.trace_engine_step import profile_decode_steps
        try:
            emit(bs1_profile=profile_decode_steps(engine, prompts(1)))
        except Exception as e:  # a diagnostic: the figures go on without it
            emit(bs1_profile_error=repr(e)[:300])

    params_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.params))
    before = compiles[0]
    rates = measure_rooflines(params_bytes) if not tiny else dict(
        hbm_bytes_s=1e11, matmul_flop_s=1e12, weight_bytes=params_bytes)
    emit(**roofline_figures(rates, engine.cfg, prompt_len, out_len, 256))
    compiles[0] = before  # (the roofline kernels' own)

    c256_prompts = prompts(256)
    runs_done = [0]

    def c256(run: str):
        """`run`: "base", "async" (--async-launch) or "loop<K>" (the scheduler's
        --decode-steps-per-call; the engine compiled its decode loops for the largest K); fresh
        prompts each run (no prefix-cache hits)."""
        label = "c256" if run == "base" else f"c256_{run}"
        loop_steps = int(run[4:]) if run.startswith("loop") else 1
        nonlocal c256_prompts
        if time.perf_counter() > deadline - 20:
            emit(**{f"{label}_skipped": "deadline"})
            return
        if runs_done[0]:
            c256_prompts = prompts(256)
        runs_done[0] += 1
        engine.scheduler.decode_steps_per_call = loop_steps
        engine.runner.set_async_launch(run == "async")
        engine.stats.__init__()
        window = TimedWindow(engine)
        t0 = time.perf_counter()
        timed = token_times(engine, [(p, out_len) for p in c256_prompts], len(c256_prompts))
        elapsed = time.perf_counter() - t0
        n_out = sum(len(t) for t in timed["arrivals"].values())
        st = engine.stats
        emit(**window.figures(label), **c256_phases(timed, t0, label),
             **{f"{label}_out_tok_s": round(n_out / elapsed, 1),
                f"{label}_host_ms_per_step": round(st.host_ms_per_step, 3),
                f"{label}_host_phases_ms": st.breakdown_ms(),
                f"{label}_step_period_ms": round(1e3 * elapsed / max(st.steps, 1), 3),
                f"{label}_device_idle_at_dispatch": st.idle_dispatches,
                f"{label}_sync_gaps": st.sync_gaps, f"{label}_steps": st.steps,
                "compiles_after_all_buckets": compiles[0]})
        engine.scheduler.decode_steps_per_call = engine.runner.decode_steps_per_call
        engine.runner.set_async_launch(False)

    def profile(key: str, fn) -> None:
        """A diagnostic of 256 decoding sequences over the last c256 run's prompts (the prefix
        cache holds them, so the decodes start at once)."""
        if time.perf_counter() > deadline - 10:
            emit(**{f"{key}_skipped": "deadline"})
            return
        try:
            emit(**{key: fn(engine, c256_prompts, steps=16)})
        except Exception as e:  # a diagnostic: the figures go on without it
            emit(**{f"{key}_error": repr(e)[:300]})

    from jaxinfer.bench.profile.profile_host_step import launch_costs, launch_variants, profile_host_steps
    from jaxinfer.bench.profile.trace_engine_step import profile_decode_steps
    # The first c256 run, the device trace (the figure most worth having), the other decode-loop
    # lengths, then the host profiles; the scheduler takes single steps in the profiles.
    if "c256" in parts:
        c256(runs[0])
    if "c256prof" in parts and not tiny:
        profile("c256_device_profile", profile_decode_steps)
    if "c256" in parts:
        for run in runs[1:]:
            c256(run)
    if "c256prof" in parts:
        profile("c256_host_profile", profile_host_steps)
        profile("launch_costs", lambda engine, _, steps: launch_costs(engine))
        if not tiny and time.perf_counter() < deadline - 30:  # (a compile per variant)
            profile("launch_variants", lambda engine, _, steps: launch_variants(engine, {
                "default": {}, "no_command_buffers": {"xla_gpu_enable_command_buffer": ""}}))
    if "c64" not in parts:
        return
    n64 = 16 if tiny else 192
    lengths = [int(n) for n in rng.integers(out_len // 2, out_len * 3 // 2, n64)]
    c64_runs: dict[int, dict] = {}
    for budget in caps:
        label = f"c64_cap{budget}" if budget else "c64_nocap"
        if time.perf_counter() > deadline - 14:
            emit(**{f"{label}_skipped": "deadline"})
            continue
        # (the engine's ITL target object holds the flag's bound and sets the scheduler's cap)
        engine.itl.static_cap = engine.scheduler.max_step_tokens_while_decoding = budget or None
        engine.stats.__init__()
        window = TimedWindow(engine)
        t0 = time.perf_counter()
        run = token_times(engine, list(zip(prompts(n64), lengths)), 64)  # (new: no prefix hits)
        figs = latency_figures(run, time.perf_counter() - t0)
        c64_runs[budget] = figs
        emit(**window.figures(label), **{f"{label}_{k}": v for k, v in figs.items()},
             **{f"{label}_host_ms_per_step": round(engine.stats.host_ms_per_step, 3),
                "compiles_after_all_buckets": compiles[0]})
        engine.scheduler.decode_steps_per_call = engine.runner.decode_steps_per_call
        engine.runner.set_async_launch(False)
    engine.itl.static_cap = engine.scheduler.max_step_tokens_while_decoding = None
    if c64_runs:
        emit(**c64_headline(c64_runs))


# ---- the driver -------------------------------------------------------------------------------
def run_child(argv: list[str], limit_s: float, on_result) -> dict:
    """Run an engine process; READY's time since the start, each RESULT line passed to
    `on_result` as it arrives. Past `limit_s` it gets SIGABRT (faulthandler prints its stacks)."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    out: dict = {"tail": []}
    while True:
        try:
            line = lines.get(timeout=max(0.1, limit_s - (time.perf_counter() - start)))
        except queue.Empty:
            proc.send_signal(signal.SIGABRT)
            out["timed_out"] = True
            time.sleep(5)
            proc.kill()
            break
        if line is None:
            break
        if line.startswith(READY):
            out["ready_s"] = round(time.perf_counter() - start, 2)
        elif line.startswith(RESULT):
            on_result(json.loads(line[len(RESULT):]))
        else:
            out["tail"] = (out["tail"] + [line.rstrip()])[-40:]
        print(line, end="", flush=True)
    out["rc"] = proc.wait()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the demo model at tiny sizes (CPU check)")
    ap.add_argument("--deadline-s", type=float, default=190.0)
    ap.add_argument("--caps", default="256,0,512",
                    help="--max-step-tokens-while-decoding of each c64 run (0: none)")
    ap.add_argument("--num-blocks", type=int, default=16384,
                    help="KV blocks (skips the memory planner's compile; 0: plan them)")
    ap.add_argument("--warm-reserve-s", type=float, default=20.0,
                    help="seconds of --deadline-s kept for the warm start")
    ap.add_argument("--backend", default="mosaic")
    ap.add_argument("--cache-dir", default=None,
                    help="the --compilation-cache-dir both processes share (default: a fresh "
                         "one; it must start empty for the cold figure)")
    ap.add_argument("--parts", default="bs1,c256,c64,warm",
                    help="workloads to run, of bs1, c256, c256prof (host and device profiles of "
                         "256 decoding sequences), c64, warm (the second process)")
    ap.add_argument("--c256-runs", default="base",
                    help="c256 runs in one process: base, async (--async-launch), loop<K> "
                         "(--decode-steps-per-call K; the engine compiles the decode loops for "
                         "the largest K); keys c256_* for base, c256_<run>_* for the others")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the engine's step token budget (its default: 2048)")
    ap.add_argument("--engine-process", default=None, help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, "engine_llama8b_<gpu>")
    args = ap.parse_args(argv)
    if args.engine_process:
        spec = json.loads(args.engine_process)
        return engine_process(spec["opts"], spec["mode"], args.tiny,
                              [int(c) for c in args.caps.split(",")], spec["left_s"],
                              set(args.parts.split(",")), args.c256_runs.split(","))

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_llama8b_"))
    if args.tiny:
        opts = dict(model=str(REPO_ROOT / "checkpoints" / "demo-target"), dtype="float32",
                    max_num_seqs=64, max_num_batched_tokens=256, max_model_len=256,
                    num_blocks=args.num_blocks and 1024)
    else:
        model = work / "llama3-8b-shape"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(LLAMA3_8B))
        opts = dict(model=str(model), load_format="dummy", dtype="bfloat16",
                    attention_backend=args.backend, max_num_seqs=256,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
                    num_blocks=args.num_blocks or None, gpu_memory_utilization=0.85)
    opts["compilation_cache_dir"] = args.cache_dir or str(work / "cache")
    loops = [int(r[4:]) for r in args.c256_runs.split(",") if r.startswith("loop")]
    if loops:
        opts["decode_steps_per_call"] = max(loops)
    metrics: dict = {}
    machine: dict = {}
    config = dict(engine=opts, caps=args.caps, model="Llama-3-8B shape, random bf16 weights"
                  if not args.tiny else "demo model, float32")

    def on_result(r: dict) -> None:
        machine.update(r.pop("machine", {}))
        metrics.update(r)
        if args.save and machine:
            name = args.name or "engine_llama8b_" + (
                "cpu" if machine.get("platform") == "cpu"
                else machine["device"].split()[-1].lower())
            results_io.save(args.save, name, config=config, metrics=metrics,
                            machine_info={**results_io.machine(), **machine})

    for mode in ("cold", "warm") if "warm" in args.parts.split(",") else ("cold",):
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 10:
            metrics[f"{mode}_skipped"] = "deadline"
            continue
        limit = (left - args.warm_reserve_s if mode == "cold" and "warm" in args.parts.split(",")
                 else left)
        spec = json.dumps(dict(opts=opts, mode=mode, left_s=limit - 5))
        child = run_child([sys.executable, "-m", __spec__.name, "--engine-process", spec, "--caps",
                           args.caps, "--parts", args.parts, "--c256-runs", args.c256_runs]
                          + (["--tiny"] if args.tiny else []),
                          limit, on_result)
        if "ready_s" in child:
            on_result({f"time_to_ready_{mode}_s": child["ready_s"]})
        if child["rc"] != 0:
            on_result({f"{mode}_error": f"rc {child['rc']}"
                       + (" (timed out)" if child.get("timed_out") else ""),
                       f"{mode}_log_tail": child["tail"][-15:]})
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
