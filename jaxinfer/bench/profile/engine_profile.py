"""`--profile KIND ...` of `jaxinfer bench throughput | latency`: after the timed run, where the
same engine's steady decode step spends its time, over --profile-decode-steps steps of a batch of
the run's prompt length (its batch, at most --max-num-seqs):

  host    cProfile around the steps: wall ms per step, the engine's phase split (schedule, build,
          launch, wait, process) and the functions with the most own time (profile_host_step.py)
  device  jax's profiler (CUPTI) around the steps: step period, kernel-busy and idle time per
          step, kernels per step and the top kernels (trace_engine_step.py; needs a GPU)
  probe   whether the host is the critical path: step wall time beside its phases, launch CPU
          time, compiles, retraces and implicit transfers in the steady steps (engine_host_probe.py)
"""

from __future__ import annotations

import argparse
import json

KINDS = ("host", "device", "probe")


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profile (after the timed run)")
    g.add_argument("--profile", nargs="+", choices=KINDS, default=None, metavar="KIND",
                   help=f"profile the steady decode step: {', '.join(KINDS)} (see the "
                        "description of jaxinfer/bench/profile/engine_profile.py)")
    g.add_argument("--profile-decode-steps", type=int, default=20,
                   help="decode steps each --profile kind runs")


def profile_engine(engine, prompts: list[list[int]], kinds: list[str], steps: int) -> dict:
    """{kind: its figures} for the steady decode steps of `prompts` on `engine`; each kind's
    requests are aborted before the next starts."""
    out = {}
    for kind in kinds:
        if kind == "host":
            from jaxinfer.bench.profile.profile_host_step import profile_host_steps
            out[kind] = profile_host_steps(engine, prompts, steps=steps)
        elif kind == "device":
            import jax
            if jax.default_backend() != "gpu":
                out[kind] = {"error": "the device trace reads CUPTI's GPU plane: needs a GPU"}
                continue
            from jaxinfer.bench.profile.trace_engine_step import profile_decode_steps
            out[kind] = profile_decode_steps(engine, prompts, steps=steps)
        else:
            from jaxinfer.bench.profile.engine_host_probe import probe_host
            out[kind] = probe_host(engine, prompts, steps=steps)
        print(f"profile {kind}: {json.dumps(out[kind], indent=1)}", flush=True)
    return out
