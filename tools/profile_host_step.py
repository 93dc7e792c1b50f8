"""Where the host spends a steady decode step of the engine: cProfile around a few `step()` calls of
running requests, the engine's own phase split (`EngineStats.breakdown_ms`), and the functions
with the most own time.

    from tools.profile_host_step import profile_host_steps
    summary = profile_host_steps(engine, [prompt_ids] * 256, steps=20)

    JAX_PLATFORMS=cpu PYTHONPATH=. python tools/profile_host_step.py --num-seqs 256   # demo model

The requests are added and stepped until each has its first token (prefill done); then `steps`
engine steps run under the profiler (and, separately, without it: the wall time per step and the
phase split, which the profiler would inflate), and the requests are aborted.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from jaxinfer.sampling_params import SamplingParams


def _start(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while len(started) < len(rids):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    engine.step()  # the steady state: one step in flight
    return rids


def _stop(engine, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def top_functions(stats: pstats.Stats, steps: int, top: int) -> dict[str, float]:
    """Own time (ms per step) of the `top` functions with the most of it."""
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():
        rows.append((tottime, f"{Path(path).name}:{line}({name})"))
    rows.sort(reverse=True)
    return {label: round(1e3 * t / steps, 3) for t, label in rows[:top]}


def profile_host_steps(engine, prompts: list[list[int]], steps: int = 20, top: int = 25) -> dict:
    """Time `steps` pure-decode steps of len(prompts) running requests, then profile as many."""
    rids = _start(engine, prompts, 2 * steps + 16, "hostprof")
    engine.stats.__init__()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    phases = engine.stats.breakdown_ms()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    _stop(engine, rids)
    stats = pstats.Stats(prof, stream=io.StringIO())
    cumulative = {}
    for (path, line, name), (_, _, _, cumtime, _) in stats.stats.items():
        if name in ("schedule", "execute", "process", "_collect", "result", "build",
                    "_update_gauges", "update_from_output", "_run_step"):
            cumulative[f"{Path(path).name}:{name}"] = round(1e3 * cumtime / steps, 3)
    return dict(num_seqs=len(prompts), steps=steps, ms_per_step=round(1e3 * wall / steps, 3),
                phases_ms=phases, profiled_cumulative_ms=cumulative,
                profiled_top_own_ms=top_functions(stats, steps, top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "checkpoints"
                                           / "demo-target"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import json

    import numpy as np

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype="float32", max_num_seqs=args.num_seqs,
        max_num_batched_tokens=max(2048, args.num_seqs), max_model_len=512,
        num_blocks=args.num_seqs * 8 + 64, background_compile=False))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.cfg.vocab_size, args.prompt_len).tolist()
               for _ in range(args.num_seqs)]
    json.dump(profile_host_steps(engine, prompts, args.steps), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
