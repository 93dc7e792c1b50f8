"""`jaxinfer bench throughput --structured-output`: the throughput cost of structured output. The
same batch of --num-prompts requests, each generating exactly --output-len tokens, run
unconstrained, all constrained by a JSON schema, and half and half.

    jaxinfer bench throughput --structured-output --dtype float32 --input-len 32 --output-len 64 \
        --repeats 3 --save                                     # demo model, c = 64

Every row generates exactly --output-len tokens (min_tokens = max_tokens, and a schema that cannot
close sooner: an array of at least 1000 digits), so the modes compare the same work. Reported per
mode: output tokens/s (best of --repeats, the modes interleaved so a busy spell of the machine hits
all alike), process CPU time per output token (steadier than wall time on a shared machine), the
host's bitmask time per masked step, and how often the engine processed a step before scheduling
the next (constrained rows need their matcher up to date) with the device-idle time that cost; plus
constrained and mixed throughput relative to unconstrained, both ways. Compilation is not timed (an
untimed first run of each mode compiles its shapes). Every run has its own random prompts (each
run's `prefix_hit_rate` shows the prefix cache skipped no prefill).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from jaxinfer.bench import results_io
from jaxinfer.bench.timed_window import TimedWindow, fresh_prompts
from jaxinfer.engine.args import EngineArgs
from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import StructuredOutputsParams
from jaxinfer.worker import step_inputs

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1000}


class MaskTimer:
    """Wraps step_inputs.step_bitmask to total the host time spent filling bitmasks."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self._inner = step_inputs.step_bitmask

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._inner(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run_once(llm: LLM, prompts, params_list, timer: MaskTimer) -> dict:
    engine = llm.engine
    engine.stats.__init__()
    timer.seconds, timer.calls = 0.0, 0
    window = TimedWindow(engine)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params_list, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    st = engine.stats
    return dict(elapsed_s=round(elapsed, 3), output_tokens=n_out,
                output_tokens_per_s=round(n_out / elapsed, 1), cpu_s=round(cpu, 3),
                cpu_ms_per_output_token=round(1e3 * cpu / n_out, 3), steps=st.steps,
                mask_ms_per_masked_step=round(1e3 * timer.seconds / max(timer.calls, 1), 3),
                masked_steps=timer.calls, sync_gaps=st.sync_gaps, sync_gap_ms=round(st.sync_gap_ms, 3),
                host_ms_per_step=round(st.host_ms_per_step, 3), **window.figures())


def run(args: argparse.Namespace) -> dict:
    """The throughput driver's flags: --num-prompts rows (the batch), --input-len, --output-len,
    --repeats, the engine's; the record (--save) is structured_<device>."""
    args.concurrency = args.num_prompts
    # One batch of `concurrency` rows; the shapes it uses compile in each mode's untimed first run.
    args.max_num_seqs, args.warmup = args.concurrency, False
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    llm = LLM(engine=engine)
    timer = MaskTimer()
    step_inputs.step_bitmask = timer
    vocab = engine.cfg.vocab_size
    c = args.concurrency
    seeds = itertools.count()  # every run its own prompts: none is in the prefix cache

    def prompts() -> list[list[int]]:
        return fresh_prompts(vocab, c, args.input_len, seed=next(seeds))
    n = args.output_len
    free = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    constrained = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    modes = {"unconstrained": [free] * c, "constrained": [constrained] * c,
             "mixed": [constrained if i % 2 else free for i in range(c)]}
    for params_list in modes.values():  # compiles each mode's shapes
        llm.generate(prompts(), params_list, use_tqdm=False)
    metrics: dict = {}
    all_runs: dict = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, params_list in modes.items():
            run = run_once(llm, prompts(), params_list, timer)
            print(name, run, flush=True)
            all_runs[name].append(run)
            if name not in metrics or run["output_tokens_per_s"] > metrics[name]["output_tokens_per_s"]:
                metrics[name] = run
    def median_cpu(name: str) -> float:
        return statistics.median(run["cpu_ms_per_output_token"] for run in all_runs[name])

    base = metrics["unconstrained"]
    for name in ("constrained", "mixed"):
        # throughput relative to unconstrained: wall clock (best runs), and the median process CPU
        # time per output token (steadier where other work shares the machine)
        metrics[f"{name}_vs_unconstrained"] = round(
            metrics[name]["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
        metrics[f"{name}_vs_unconstrained_cpu_time"] = round(
            median_cpu("unconstrained") / median_cpu(name), 3)
    for key in ("output_tokens_per_s", "cpu_ms_per_output_token"):
        metrics[f"all_runs_{key}"] = {name: [run[key] for run in runs] for name, runs in all_runs.items()}
    print({k: v for k, v in metrics.items() if "_vs_" in k})
    if args.save:
        name = args.name or f"structured_{results_io.device_slug()}"
        results_io.save(args.save, name, config=dict(
            model=args.model, concurrency=c, input_len=args.input_len, output_len=n,
            repeats=args.repeats, schema=SCHEMA, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
            decode_steps_per_call=args.decode_steps_per_call), metrics=metrics)
    return metrics
