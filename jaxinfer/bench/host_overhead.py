"""The engine's host-side work per decode step, with the device taken out of the loop:
`Scheduler.schedule()` + `ModelRunner.build()` (the padded step arrays) for --num-seqs running
sequences, target <= 1 ms for 256; and the output side of a step (append, stop checks, the
scheduler's update, the RequestOutputs and gauges), fed a fixed token per row. Medians over
--steps steps. `--logprobs K` asks every request for logprobs (the step then carries a logprob,
and K top alternatives, per row) and also times the same steps without
(`process_outputs_no_logprobs_ms`); `--final-output-only` builds no RequestOutput until a request
finishes, as `LLM.generate` does (an RL rollout's path).

    jaxinfer bench throughput --host-overhead --num-seqs 256 [--logprobs 0] [--final-output-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.runner import StepHandle, StepResult


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


def _host_overhead(args: argparse.Namespace, logprobs: int | None, setup=None) -> dict:
    """`setup(engine)`: called once the engine is built (host_path.py: token diffs)."""
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
    if setup is not None:
        setup(engine)
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
