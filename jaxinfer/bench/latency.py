"""`jaxinfer bench latency`: the latency of one batch, after `vllm bench latency`.

--batch-size random-token prompts of --input-len tokens, each generating exactly --output-len
tokens (ignore_eos), through `LLM.generate`, --num-iters-warmup times untimed and then
--num-iters times timed; prints the mean and the 10/25/50/75/90/99th percentiles in seconds, and
--output-json writes vLLM's file (avg_latency, std_latency, latencies, percentiles). The prefix
cache is off by default, as in vLLM: every iteration sends the same prompts, and with the cache
on the later ones would skip their prefill. --suite NAME runs one of the Llama-3-8B suites
instead (jaxinfer/bench/suites/: llama8b, bs1-step, bs1-paths, dispatch-sync), its own flags after
`--`.

    jaxinfer bench latency --input-len 32 --output-len 128 --batch-size 8
    jaxinfer bench latency --preset llama8b --batch-size 1 --output-json bs1.json
    jaxinfer bench latency --suite llama8b --save -- --parts bs1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from jaxinfer.bench import common, presets, results_io
from jaxinfer.bench.profile import engine_profile
from jaxinfer.bench.suites import add_suite_args, run_suite
from jaxinfer.bench.timed_window import fresh_prompts
from jaxinfer.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's


def latency(args: argparse.Namespace) -> dict:
    llm = common.build_llm(args)
    prompts = fresh_prompts(llm.engine.cfg.vocab_size, args.batch_size, args.input_len, seed=1, low=0)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.output_len, ignore_eos=True)

    def one() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in range(args.num_iters_warmup):
        one()
    latencies = np.array([one() for _ in range(args.num_iters)])
    pct = np.percentile(latencies, PERCENTILES)
    result = {"avg_latency": float(latencies.mean()), "std_latency": float(latencies.std()),
              "latencies": latencies.tolist(),
              "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, pct)}}
    print(f"Avg latency: {result['avg_latency']} seconds")
    print(f"Std latency: {result['std_latency']} seconds")
    for p, v in zip(PERCENTILES, pct):
        print(f"{p}% percentile latency: {v} seconds")
    if args.profile:
        result["profile"] = engine_profile.profile_engine(llm.engine, prompts, args.profile,
                                                          args.profile_decode_steps)
    return result


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("latency", help="offline: seconds per batch, end to end, over many iterations",
                       description=__doc__, formatter_class=common.HelpFormatter,
                       usage=common.USAGE)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    g.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    g.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    g.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    common.add_output_json(g, "the latencies")
    add_suite_args(p, "latency")
    common.add_record_args(p, "latency_<model>_<device>")
    engine_profile.add_profile_args(p)
    common.add_engine_args(p)
    p.set_defaults(func=run, _parser=p, enable_prefix_caching=False)
    return p


def run(args: argparse.Namespace) -> int:
    if args.suite_args and not args.suite:
        args._parser.error("flags after -- need --suite NAME")
    if args.suite:
        return run_suite(args)
    presets.apply(args, args._parser)
    for flag in ("batch_size", "n", "num_iters"):
        if getattr(args, flag) < 1:
            args._parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    result = latency(args)
    if args.output_json:
        common.write_json(args.output_json, result)
    if args.save:
        name = args.name or f"latency_{args.preset or Path(args.model).name}_{results_io.device_slug()}"
        metrics = {"avg_latency_s": result["avg_latency"], "std_latency_s": result["std_latency"],
                   **{f"p{p}_latency_s": v for p, v in result["percentiles"].items()}}
        results_io.save(args.save, name, config=common.record_config(args), metrics=metrics)
    return 0
