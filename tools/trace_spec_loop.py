"""Where the demo's EAGLE-3 loop spends its device time, beside the plain decode loop: jax's
profiler (CUPTI) around a few engine steps of one running request (c = 1, greedy), summarized per
dispatch (one engine step: the on-device speculative loop of N iterations, or the N-step decode
loop): the device period, kernel-busy and idle time, kernels launched, and the kernels with the
most time.

    python -m tools.trace_spec_loop [--steps 12] [--target DIR] [--eagle DIR] [--out FILE]

Run it with XLA_FLAGS set to compare runtime options (e.g. command buffers holding the loops:
`--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`; add
`--xla_enable_command_buffers_during_profiling=true`, or the profiler turns them off).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax

from benchmarks.bench_spec_decode import DEMO, DEMO_EAGLE, demo_prompts, engine
from jaxinfer.sampling_params import SamplingParams
from tools.trace_decode import device_events
from tools.trace_engine_step import summarize_steps


def trace_steps(e, prompt: str, steps: int) -> dict:
    """Warm up one request (compiles every shape), then trace `steps` engine steps of another."""
    params = SamplingParams(temperature=0.0, max_tokens=40 * steps, ignore_eos=True)
    e.add_request("warm", prompt, params)
    while e.has_unfinished_requests():
        e.step()
    e.add_request("traced", prompt[::-1], params)
    while not any(o.outputs[0].token_ids for o in e.step()):
        pass
    for _ in range(2):
        e.step()
    counts = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            counts += [len(o.outputs[0].token_ids) for o in e.step()]
        jax.block_until_ready(e.runner.last_tokens)
        jax.profiler.stop_trace()
        wall = time.perf_counter() - t0
        events = device_events(trace_dir)
    out = summarize_steps(events, steps, top=20)
    out["wall_ms_per_step"] = round(1e3 * wall / steps, 3)
    out["tokens_per_step"] = round((counts[-1] - counts[0]) / max(len(counts) - 1, 1), 2)
    e.abort("traced")
    while e.has_unfinished_requests():
        e.step()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--target", default=str(DEMO))
    p.add_argument("--eagle", default=str(DEMO_EAGLE))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompt = demo_prompts(1)[0]
    spec = json.dumps({"method": "eagle3", "model": a.eagle, "num_speculative_tokens": a.k})
    out = {}
    for name, kwargs in (("nospec", {}), ("eagle", dict(speculative_config=spec))):
        e = engine(a.target, max_num_seqs=8, **kwargs)
        out[name] = trace_steps(e, prompt, a.steps)
        print(name, json.dumps(out[name]), flush=True)
        del e
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
