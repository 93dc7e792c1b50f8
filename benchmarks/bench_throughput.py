"""Offline throughput, shaped like vLLM's benchmark_throughput, plus the engine's host overhead.

    python -m benchmarks.bench_throughput --model DIR --input-len 128 --output-len 128 --num-prompts 64
    python -m benchmarks.bench_throughput --host-overhead --num-seqs 256
    python -m benchmarks.bench_throughput --host-overhead --logprobs 0 --final-output-only

Throughput: N random-token prompts of --input-len tokens, each generating exactly --output-len tokens
(ignore_eos), through `LLM.generate`; prints `Throughput: X requests/s, Y total tokens/s, Z output
tokens/s` as vLLM does, after a warm-up on other prompts (compilation is not timed, and the timed
prompts are new to the prefix cache); the result carries the timed window's `prefix_hit_rate` and
the step buckets still compiling when it began (`buckets_compiling`; `--no-background-compile`
compiles them all first).

Host overhead: the host-side work of one steady-state decode step for --num-seqs running sequences,
i.e. `Scheduler.schedule()` + `ModelRunner.build()` (the padded step arrays), with no device work;
target <= 1 ms for 256 sequences. Reported as the median over --steps steps; also the output
side of a step (the engine's processing of a step's tokens: append, stop checks, the scheduler's
update, the RequestOutputs and gauges), fed a fixed token per row. `--logprobs K` asks every
request for logprobs (the step then carries a logprob, and K top alternatives, per row) and also
times the same steps without (`process_outputs_no_logprobs_ms`); `--final-output-only` builds no
RequestOutput until a request finishes, as `LLM.generate` does (an RL rollout's path).

Prefill burst (`--prefill-burst`, issue 61): --streams requests decode while one request of
--burst-prompts x --burst-len fresh prompts arrives (ids `<id>#<i>`, as the server names them);
each run with the ITL target off and on (--itl-target-ms, default auto), after a first pass of
both: the streams' inter-token latency p99 before the burst (`idle_itl_p99_ms`) and during it
(`burst_itl_p99_ms`, `..._no_target`), and the burst's prompt tokens over the time until its last
prompt had its first token (`burst_prefill_tok_s`, `..._no_target`); `prefix_hit_rate` over the
timed windows. `--shape llama3-8b` serves the Llama-3-8B shape with random weights; `--smoke` the
demo model at tiny sizes (a CPU check):

    python -m benchmarks.bench_throughput --prefill-burst --shape llama3-8b --save --name fairness_h200
    JAX_PLATFORMS=cpu python -m benchmarks.bench_throughput --prefill-burst --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results_io
from benchmarks.timed_window import TimedWindow, fresh_prompts, prefix_counters
from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.args import EngineArgs
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.runner import StepHandle, StepResult


def throughput(args: argparse.Namespace) -> dict:
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine.from_engine_args(engine_args)
    llm = LLM(engine=engine)
    vocab = engine.cfg.vocab_size
    prompts = fresh_prompts(vocab, args.num_prompts, args.input_len, seed=1, low=0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True)
    # The warm-up's prompts are not the timed ones: the prefix cache would skip their prefill.
    llm.generate(fresh_prompts(vocab, 2, args.input_len, seed=0, low=0),
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine.stats.__init__()
    window = TimedWindow(engine)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    st = engine.stats
    result = dict(elapsed_time=elapsed, num_requests=len(outs), total_num_tokens=n_in + n_out,
                  num_output_tokens=n_out, requests_per_second=len(outs) / elapsed,
                  tokens_per_second=(n_in + n_out) / elapsed, output_tokens_per_second=n_out / elapsed,
                  steps=st.steps, host_ms_per_step=st.host_ms_per_step,
                  overlapped_dispatches_device_already_idle=st.idle_dispatches,
                  sync_gap_ms=st.sync_gap_ms, platform=jax.devices()[0].platform,
                  **window.figures())
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {n_in}")
    print(f"Total num output tokens:  {n_out}")
    print(f"Engine steps: {st.steps}, host (schedule + build + dispatch) {st.host_ms_per_step:.3f} "
          f"ms/step, overlapped dispatches that found the device idle: {st.idle_dispatches}")
    return result


def host_overhead(args: argparse.Namespace) -> dict:
    """Steady-state decode of --num-seqs sequences with the device taken out of the loop."""
    result = _host_overhead(args, args.logprobs)
    if args.logprobs is not None:
        plain = _host_overhead(args, None)
        result.update(process_outputs_no_logprobs_ms=plain["process_outputs_ms"],
                      process_outputs_no_logprobs_mean_ms=plain["process_outputs_mean_ms"])
        print(f"output processing, median (mean): {result['process_outputs_ms']:.3f} "
              f"({result['process_outputs_mean_ms']:.3f}) ms with logprobs={args.logprobs}, "
              f"{plain['process_outputs_ms']:.3f} ({plain['process_outputs_mean_ms']:.3f}) ms "
              "without")
    return result


def _host_overhead(args: argparse.Namespace, logprobs: int | None) -> dict:
    from jaxinfer.model.config import config_from_dict
    from jaxinfer.model.transformer import init_params
    from jaxinfer.sampling_params import MAX_LOGPROBS
    cfg = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "float32"})
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    n, block = args.num_seqs, 16
    max_len = args.input_len + args.steps + 256  # room for the tokens decoded while admitting
    num_blocks = n * (-(-max_len // block)) + 8
    eargs = EngineArgs(model="synthetic", max_model_len=max_len, block_size=block,
                       num_blocks=num_blocks, max_num_seqs=n, max_num_batched_tokens=max(2048, n),
                       compilation_cache_dir=None, warmup=False, dtype="float32")
    engine = LLMEngine(cfg, params, None, eargs, num_blocks=num_blocks)
    rng = np.random.default_rng(0)
    for i in range(n):
        engine.add_request(f"r{i}", rng.integers(2, cfg.vocab_size, args.input_len).tolist(),
                           SamplingParams(temperature=0.8, max_tokens=None, ignore_eos=True,
                                          logprobs=logprobs), final_output_only=args.final_output_only)
    sched_ms, build_ms, process_ms = [], [], []
    scheduler, runner = engine.scheduler, engine.runner
    # Admit and "prefill" everyone without the device: schedule until every sequence decodes.
    while engine.num_waiting or any(s.num_to_compute > 1 for s in scheduler.running):
        sched = scheduler.schedule()
        for entry in sched.scheduled:
            if entry.emits:
                entry.seq.num_pending -= 1
                entry.seq.token_ids.append(7)
    # What the device hands back: the token, its logprob, and (logprobs > 0) the alternatives.
    top = bool(logprobs)
    result = StepResult(np.full((1, n), 7, np.int32),
                        None if logprobs is None else np.full((1, n), -1.5, np.float32),
                        np.tile(np.arange(MAX_LOGPROBS, dtype=np.int32), (1, n, 1)) if top else None,
                        np.full((1, n, MAX_LOGPROBS), -2.5, np.float32) if top else None)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sched = scheduler.schedule()
        t1 = time.perf_counter()
        runner.build(sched)
        t2 = time.perf_counter()
        # The engine's whole output side: tokens -> sequences, scheduler update, RequestOutputs.
        handle = StepHandle(sched, None, 1, t2, False)
        handle._result = result
        outs = engine._collect(engine._process(handle))
        engine._update_gauges()
        t3 = time.perf_counter()
        assert len(outs) == (0 if args.final_output_only else n)
        assert not any(o.finished for o in outs) and len(sched.decodes) == n
        sched_ms.append(1e3 * (t1 - t0))
        build_ms.append(1e3 * (t2 - t1))
        process_ms.append(1e3 * (t3 - t2))
    med = statistics.median
    result = dict(num_seqs=n, steps=args.steps, schedule_ms=med(sched_ms), build_ms=med(build_ms),
                  schedule_plus_build_ms=med([a + b for a, b in zip(sched_ms, build_ms)]),
                  process_outputs_ms=med(process_ms),
                  # The mean counts the garbage collector's passes, which the median leaves out.
                  process_outputs_mean_ms=statistics.fmean(process_ms))
    print(f"host overhead per decode step, {n} sequences, logprobs={logprobs} (median of "
          f"{args.steps}): schedule {result['schedule_ms']:.3f} ms + build inputs "
          f"{result['build_ms']:.3f} ms = {result['schedule_plus_build_ms']:.3f} ms; output "
          f"processing {result['process_outputs_ms']:.3f} ms (mean "
          f"{result['process_outputs_mean_ms']:.3f} ms)")
    return result


def prefill_burst(args: argparse.Namespace) -> dict:
    """Streams decoding while a burst of long prompts arrives, with the ITL target off and on."""
    if args.streams + 1 > args.max_num_seqs:
        raise ValueError(f"--streams {args.streams} leave the burst no slot of --max-num-seqs "
                         f"{args.max_num_seqs}")
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    target = args.itl_target_ms or "auto"
    vocab, seed = engine.cfg.vocab_size, iter(range(1, 1 << 20))
    window_counts = [0, 0]  # prompt tokens looked up and found over the timed windows

    def run(itl_target, tag: str) -> dict:
        engine.itl.target = itl_target
        streams = [f"{tag}-s{i}" for i in range(args.streams)]
        for rid, prompt in zip(streams, fresh_prompts(vocab, args.streams, args.stream_len,
                                                      next(seed))):
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                               max_tokens=engine.max_model_len - args.stream_len - 1))
        arrivals: dict[str, list[float]] = {rid: [] for rid in streams}

        def step() -> list:
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id in arrivals:
                    arrivals[o.request_id] += [now] * len(o.outputs[0].new_token_ids)
            return outs

        while not all(arrivals.values()):
            step()
        window = TimedWindow(engine)
        idle_start = time.perf_counter()
        for _ in range(args.idle_steps):
            step()
        burst = [f"{tag}-burst#{i}" for i in range(args.burst_prompts)]
        burst_start = time.perf_counter()
        for rid, prompt in zip(burst, fresh_prompts(vocab, args.burst_prompts, args.burst_len,
                                                    next(seed))):
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                           ignore_eos=True))
        left, steps = set(burst), 0
        while left:
            left -= {o.request_id for o in step() if o.finished}
            steps += 1
        burst_end = time.perf_counter()
        queries, hits = window.start
        now_queries, now_hits = prefix_counters(engine)
        window_counts[0] += now_queries - queries
        window_counts[1] += now_hits - hits
        for rid in streams:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()

        def itl_p99(lo: float, hi: float) -> float:
            """Of the gaps that end in (lo, hi] (and start after the streams' prefills)."""
            gaps = sorted(b - a for times in arrivals.values() for a, b in zip(times, times[1:])
                          if lo < b <= hi and a >= idle_start)
            return round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2)
        return dict(idle_itl_p99_ms=itl_p99(idle_start, burst_start),
                    burst_itl_p99_ms=itl_p99(burst_start, burst_end),
                    burst_prefill_tok_s=round(len(burst) * args.burst_len
                                              / (burst_end - burst_start), 1),
                    burst_s=round(burst_end - burst_start, 3), burst_steps=steps)

    runs = []
    for rep in range(2):  # the first pass meets every step shape once (and fits the step times)
        runs.append({"off": run(None, f"r{rep}off"), "on": run(target, f"r{rep}on")})
    off, on = runs[-1]["off"], runs[-1]["on"]
    result = dict(idle_itl_p99_ms=on["idle_itl_p99_ms"],
                  idle_itl_p99_ms_no_target=off["idle_itl_p99_ms"],
                  burst_itl_p99_ms=on["burst_itl_p99_ms"],
                  burst_itl_p99_ms_no_target=off["burst_itl_p99_ms"],
                  burst_prefill_tok_s=on["burst_prefill_tok_s"],
                  burst_prefill_tok_s_no_target=off["burst_prefill_tok_s"],
                  burst_s=on["burst_s"], burst_s_no_target=off["burst_s"],
                  burst_steps=on["burst_steps"], burst_steps_no_target=off["burst_steps"],
                  itl_target=target, itl_target_ms_at_streams=round(
                      1e3 * (engine.itl.target_seconds(args.streams) or 0), 2),
                  step_ms_by_tokens={int(x): round(1e3 * t, 2)
                                     for x, t in zip(*engine.itl.model.curve())},
                  prefix_hit_rate=round(window_counts[1] / max(window_counts[0], 1), 4),
                  first_pass=runs[0], platform=jax.devices()[0].platform)
    result["burst_itl_over_idle"] = round(result["burst_itl_p99_ms"] / result["idle_itl_p99_ms"], 3)
    result["burst_prefill_over_no_target"] = round(
        result["burst_prefill_tok_s"] / result["burst_prefill_tok_s_no_target"], 3)
    print(json.dumps(result, indent=1))
    return result


def burst_model(args: argparse.Namespace) -> None:
    """--shape / --smoke: the model and the sizes they stand for."""
    if args.shape == "llama3-8b":
        from benchmarks.bench_engine_gpu import LLAMA3_8B
        model = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
        (model / "config.json").write_text(json.dumps(LLAMA3_8B))
        args.model, args.load_format = str(model), "dummy"
    if args.smoke:
        args.model = str(Path(__file__).resolve().parent.parent / "checkpoints" / "demo-target")
        args.dtype, args.max_num_seqs, args.max_num_batched_tokens = "float32", 16, 128
        args.max_model_len, args.num_blocks, args.compilation_cache_dir = 512, 512, ""
        args.streams, args.stream_len, args.idle_steps = 12, 16, 16  # (> 8: no decode loop)
        args.burst_prompts, args.burst_len = 4, 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--host-overhead", action="store_true",
                   help="measure scheduler + input building per decode step instead")
    p.add_argument("--num-seqs", type=int, default=256, help="(--host-overhead) running sequences")
    p.add_argument("--steps", type=int, default=50, help="(--host-overhead) steps to time")
    p.add_argument("--logprobs", type=int, default=None,
                   help="(--host-overhead) every request asks for logprobs=K; the same steps "
                        "without logprobs are timed too")
    p.add_argument("--final-output-only", action="store_true",
                   help="(--host-overhead) no RequestOutput until a request finishes (as "
                        "LLM.generate)")
    p.add_argument("--prefill-burst", action="store_true",
                   help="streams decoding beside a burst of long prompts, ITL target off and on")
    p.add_argument("--streams", type=int, default=64, help="(--prefill-burst) decoding requests")
    p.add_argument("--stream-len", type=int, default=128, help="(--prefill-burst) their prompts")
    p.add_argument("--idle-steps", type=int, default=64,
                   help="(--prefill-burst) steps timed before the burst")
    p.add_argument("--burst-prompts", type=int, default=32, help="(--prefill-burst) prompts")
    p.add_argument("--burst-len", type=int, default=2048, help="(--prefill-burst) their tokens")
    p.add_argument("--shape", choices=["llama3-8b"], default=None,
                   help="serve this model shape with random weights (instead of --model)")
    p.add_argument("--smoke", action="store_true",
                   help="(--prefill-burst) the demo model at tiny sizes (a CPU check)")
    p.add_argument("--output-json", default=None, help="the raw result dict (bench_engine_gpu reads it)")
    results_io.add_save_arg(p, "throughput_<model>_<device> or host_overhead_<device>")
    EngineArgs.add_cli_args(p)
    args = p.parse_args()
    burst_model(args)
    try:
        result = (host_overhead(args) if args.host_overhead else
                  prefill_burst(args) if args.prefill_burst else throughput(args))
    except (JaxinferError, ValueError) as e:  # a bad flag or model directory: say which, no trace
        p.exit(2, f"{p.prog}: error: {e}\n")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    if args.save:
        slug = results_io.device_slug()
        lp = "" if args.logprobs is None else f"_logprobs{args.logprobs}"
        default = (f"host_overhead{lp}_{slug}" if args.host_overhead
                   else f"fairness_{slug}" if args.prefill_burst
                   else f"throughput_{Path(args.model).name}_{slug}")
        config = {k: v for k, v in vars(args).items() if k not in ("save", "name", "output_json")}
        metrics = result if args.prefill_burst else {
            k: v for k, v in result.items() if isinstance(v, (int, float))}
        results_io.save(args.save, args.name or default, config=config, metrics=metrics)


if __name__ == "__main__":
    main()
