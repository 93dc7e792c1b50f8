"""`jaxinfer bench throughput --prefill-burst`: fairness under a prompt burst (the ITL target).

--streams requests decode while one request of --burst-prompts x --burst-len fresh prompts arrives
(ids `<id>#<i>`, as the server names a batch's prompts). Each pass runs with the ITL target off and
then on (--itl-target-ms, default auto); a first pass meets every step shape once (compiles, and
fits the target's step-time model), and the second is the one recorded:
- the streams' inter-token latency p99 before the burst (`idle_itl_p99_ms`) and during it
  (`burst_itl_p99_ms`, `..._no_target`);
- the burst's prompt tokens over the time until its last prompt had its first token
  (`burst_prefill_tok_s`, `..._no_target`);
- `prefix_hit_rate` over the timed windows (the prompts are fresh: it should be 0).

    jaxinfer bench throughput --prefill-burst --preset llama8b_burst --save --name fairness_h200
    JAX_PLATFORMS=cpu jaxinfer bench throughput --prefill-burst --smoke   # the demo model, tiny
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from jaxinfer.bench.timed_window import TimedWindow, fresh_prompts, prefix_counters
from jaxinfer.paths import DEFAULT_MODEL
from jaxinfer.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill burst (--prefill-burst)")
    g.add_argument("--prefill-burst", action="store_true",
                   help="streams decoding beside a burst of long prompts, ITL target off and on")
    g.add_argument("--streams", type=int, default=64, help="decoding requests")
    g.add_argument("--stream-len", type=int, default=128, help="their prompts' tokens")
    g.add_argument("--idle-steps", type=int, default=64, help="steps timed before the burst")
    g.add_argument("--burst-prompts", type=int, default=32, help="prompts in the burst")
    g.add_argument("--burst-len", type=int, default=2048, help="their tokens")
    g.add_argument("--smoke", action="store_true",
                   help="the demo model at tiny sizes (a CPU check of the harness)")


def apply_smoke(args: argparse.Namespace) -> None:
    if not args.smoke:
        return
    args.model, args.load_format = str(DEFAULT_MODEL), "auto"
    args.dtype, args.max_num_seqs, args.max_num_batched_tokens = "float32", 16, 128
    args.max_model_len, args.num_blocks, args.compilation_cache_dir = 512, 512, ""
    args.streams, args.stream_len, args.idle_steps = 12, 16, 16  # (> 8: no decode loop)
    args.burst_prompts, args.burst_len = 4, 256


def prefill_burst(args: argparse.Namespace) -> dict:
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
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
    for rep in range(2):
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
