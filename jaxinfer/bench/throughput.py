"""`jaxinfer bench throughput`: offline throughput of the engine, after `vllm bench throughput`.

--num-prompts random-token prompts of --input-len tokens, each generating exactly --output-len
tokens (ignore_eos), through `LLM.generate`; prints `Throughput: X requests/s, Y total tokens/s, Z
output tokens/s` as vLLM does, after a warm-up on other prompts (compilation is not timed, and the
timed prompts are new to the prefix cache). --output-json writes vLLM's keys (elapsed_time,
num_requests, total_num_tokens, requests_per_second, tokens_per_second) and the engine's own:
steps, host ms per step, the timed window's `prefix_hit_rate` and the step buckets still compiling
when it began (`buckets_compiling`; `--no-background-compile` compiles them all first).
--host-overhead times the engine's host work per decode step instead (host_overhead.py), and
--kv-manager the KV-cache manager's alone (kv_manager_overhead.py), --host-path the serving
host path's split over the engine-core and server processes (host_path.py); --structured-output
compares constrained with unconstrained decoding (structured_cost.py); --prefill-burst times
decoding streams beside a burst of long prompts with the ITL target off and on (prefill_burst.py).
--suite NAME runs one of the model and feature suites instead (jaxinfer/bench/suites/: moe,
multi-gpu, families, mla, hybrid, kv-tiers, lora, spec-decode, research-loop, disagg, embeddings), its
own flags after `--`.

    jaxinfer bench throughput --model DIR --input-len 128 --output-len 128 --num-prompts 64
    jaxinfer bench throughput --preset llama8b --save          # Llama-3-8B shape, dummy weights
    jaxinfer bench throughput --host-overhead --num-seqs 256
    jaxinfer bench throughput --kv-manager --steps 3000 --block-size 16
    jaxinfer bench throughput --prefill-burst --preset llama8b_burst --save --name fairness_h200
    jaxinfer bench throughput --suite lora -- --impls pallas --save
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

from jaxinfer.bench import (common, host_overhead, host_path, kv_manager_overhead, prefill_burst,
                            presets, results_io, structured_cost)
from jaxinfer.bench.profile import engine_profile
from jaxinfer.bench.suites import add_suite_args, run_suite
from jaxinfer.bench.timed_window import TimedWindow, fresh_prompts
from jaxinfer.sampling_params import SamplingParams


def throughput(args: argparse.Namespace) -> dict:
    llm = common.build_llm(args)
    engine = llm.engine
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
                  host_breakdown_ms=st.breakdown_ms(),
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
    if args.profile:
        batch = fresh_prompts(vocab, min(args.num_prompts, engine.config.scheduler.max_num_seqs),
                              args.input_len, seed=2, low=0)
        result["profile"] = engine_profile.profile_engine(engine, batch, args.profile,
                                                          args.profile_decode_steps)
    return result


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("throughput", help="offline: tokens per second of a batch of prompts",
                       description=__doc__, formatter_class=common.HelpFormatter,
                       usage=common.USAGE)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    g.add_argument("--num-prompts", type=int, default=64, help="requests in the batch")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    common.add_output_json(g, "the result")
    g.add_argument("--structured-output", action="store_true",
                   help="the cost of JSON-schema-constrained decoding instead: the batch "
                        "unconstrained, all constrained and half and half (structured_cost.py)")
    g.add_argument("--repeats", type=int, default=3, help="(--structured-output) runs per mode")
    g = p.add_argument_group("host overhead (--host-overhead)")
    g.add_argument("--host-overhead", action="store_true",
                   help="time the scheduler, input building and output processing per decode "
                        "step instead, with no device work")
    g.add_argument("--host-path", action="store_true",
                   help="the serving host path's costs per decode step instead: the engine core's "
                        "output side, the IPC, the server's detokenizing (host_path.py)")
    g.add_argument("--num-seqs", type=int, default=256, help="running sequences")
    g.add_argument("--steps", type=int, default=50, help="steps to time")
    g.add_argument("--logprobs", type=int, default=None,
                   help="every request asks for logprobs=K; the same steps without are timed too")
    g.add_argument("--final-output-only", action="store_true",
                   help="no RequestOutput until a request finishes (as LLM.generate)")
    g.add_argument("--kv-manager", action="store_true",
                   help="the KV-cache manager's own work per step instead (allocate, prefix-match, "
                        "fork, free; kv_manager_overhead.py); with --block-size, --num-blocks, "
                        "--seed")
    prefill_burst.add_args(p)
    add_suite_args(p, "throughput")
    common.add_record_args(p, "throughput_<model>_<device>, host_overhead_<device> or "
                              "fairness_<device>")
    engine_profile.add_profile_args(p)
    common.add_engine_args(p)
    p.set_defaults(func=run, _parser=p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.suite_args and not args.suite:
        args._parser.error("flags after -- need --suite NAME")
    if args.suite:
        return run_suite(args)
    presets.apply(args, args._parser)
    prefill_burst.apply_smoke(args)
    if args.kv_manager or args.structured_output:  # each saves its own record
        result = (kv_manager_overhead if args.kv_manager else structured_cost).run(args)
        if args.output_json:
            common.write_json(args.output_json, result)
        return 0
    result = (host_path.host_path(args) if args.host_path else
              host_overhead.host_overhead(args) if args.host_overhead else
              prefill_burst.prefill_burst(args) if args.prefill_burst else throughput(args))
    if args.output_json:
        common.write_json(args.output_json, result)
    if args.save:
        slug = results_io.device_slug()
        lp = "" if args.logprobs is None else f"_logprobs{args.logprobs}"
        default = (f"host_path{lp}_{slug}" if args.host_path
                   else f"host_overhead{lp}_{slug}" if args.host_overhead
                   else f"fairness_{slug}" if args.prefill_burst
                   else f"throughput_{args.preset or Path(args.model).name}_{slug}")
        results_io.save(args.save, args.name or default, config=common.record_config(args),
                        metrics=result if args.prefill_burst else common.numeric(result))
    return 0
