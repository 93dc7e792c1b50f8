"""Where a steady decode step of the engine spends its device time: jax's profiler (CUPTI) around a
few decode steps of running requests, summarized per kernel name.

    from jaxinfer.bench.profile.trace_engine_step import profile_decode_steps
    summary = profile_decode_steps(engine, [prompt_ids], steps=20)

The requests are added and stepped until each has its first token (prefill done); then `steps`
engine steps run under `jax.profiler.trace`, and the requests are aborted. From the GPU plane
(trace_decode.device_events): the period of one step (first kernel start to last kernel end,
over the steps), the kernel-busy time and the idle time per step (the device waiting for the host
or between launches), the number of kernels per step, and the kernels with the most time per step
(names cut to 60 characters; a name's calls summed).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections import defaultdict

import jax

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.bench.profile.trace_decode import device_events


def busy_ns(events: list[tuple[str, int, int]]) -> int:
    """The union of the events' intervals (overlapping kernels counted once)."""
    total, end = 0, None
    for _, s, e in events:  # sorted by start
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize_steps(events: list[tuple[str, int, int]], steps: int, top: int = 15) -> dict:
    span = events[-1][2] - events[0][1]
    per_name: dict[str, int] = defaultdict(int)
    for name, s, e in events:
        per_name[name[:60]] += e - s
    busy = busy_ns(events)
    return dict(
        step_period_us=round(span / steps / 1e3, 1),
        busy_us_per_step=round(busy / steps / 1e3, 1),
        idle_us_per_step=round((span - busy) / steps / 1e3, 1),
        kernels_per_step=round(len(events) / steps, 1),
        top_kernels_us_per_step={k: round(v / steps / 1e3, 1) for k, v in
                                 sorted(per_name.items(), key=lambda kv: -kv[1])[:top]})


@contextlib.contextmanager
def single_steps(engine):
    """The engine's decode loop, if any, off while inside: one dispatched step per engine step."""
    loop_steps, engine.scheduler.decode_steps_per_call = engine.scheduler.decode_steps_per_call, 1
    try:
        yield
    finally:
        engine.scheduler.decode_steps_per_call = loop_steps


def start_decoding(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[str]:
    """Add greedy no-EOS requests for `prompts` and step until each has its first token, then
    once more (the steady state: a decode step in flight). -> their request ids"""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while len(started) < len(rids):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    engine.step()
    return rids


def stop_requests(engine, rids: list[str]) -> None:
    """Abort the requests and step the engine idle."""
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def profile_decode_steps(engine, prompts: list[list[int]], steps: int = 20) -> dict:
    """Trace `steps` pure-decode steps of len(prompts) running requests (greedy, no EOS), single
    steps (the engine's decode loop, if any, is off meanwhile)."""
    with single_steps(engine):
        rids = start_decoding(engine, prompts, steps + 8, "trace")
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            for _ in range(steps):
                engine.step()
            jax.block_until_ready(engine.runner.last_tokens)
            jax.profiler.stop_trace()
            events = device_events(trace_dir)
        stop_requests(engine, rids)
    return summarize_steps(events, steps)
