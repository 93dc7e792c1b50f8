"""Where a batch-1 decode step's time goes under tensor parallelism: the engine's steps traced with
jax's profiler (CUPTI on a GPU), every device's timeline and the host's, summarised.

    python -m jaxinfer.bench.profile.trace_tp_step [--shape llama8b] [--tp 2] [--steps 32]

It builds `LLM` on a model shape (dummy weights; `--shape` llama8b, llama70b or a model directory),
serves one batch-1 request to compile, measures the batch-1 TPOT (difference of two generation
lengths) with the engine's host counters, then traces one generation of `--steps` tokens. From
the trace it prints, per device: the period of a step, the time its streams were busy (union of
kernel intervals) and idle, the kernels by total time per step, the collectives' (NCCL) time and
the largest idle gaps; and for the host, the events (jit dispatch, PjRt execution, thunks) by
total time per step. A device busy for most of the period is device-bound; a device idle between
short kernels waits on the host. Traces and `summary.json` go under $OUT/tp_traces (or --out).
`BENCH_BACKEND=reference` runs it on a CPU (host summary only: a CPU has no device plane).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

BACKEND = os.environ.get("BENCH_BACKEND", "mosaic")
# While a profiler is on, XLA runs command buffers (CUDA graphs) thunk by thunk unless told not to:
# the trace would show launch gaps that the untraced step does not have.
TRACE_XLA_FLAGS = "--xla_enable_command_buffers_during_profiling=true"


def plane_events(path: str) -> dict[str, list[tuple[str, str, int, int]]]:
    """Every plane of an xplane file: plane name -> (line name, event name, start_ns, end_ns)."""
    from jax._src.lib import _profile_data
    data = _profile_data.ProfileData.from_file(path)
    return {plane.name: [(line.name, e.name, e.start_ns, e.end_ns) for line in plane.lines
                         for e in line.events] for plane in data.planes}


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint, sorted cover of the intervals."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def by_name(events, steps: int, top: int) -> list[dict]:
    """The `top` event names by total duration: µs per step and calls per step."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for _, name, start, end in events:
        total[name[:90]] += (end - start) / 1e3
        count[name[:90]] += 1
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    return [{"name": n, "us_per_step": round(total[n] / steps, 1),
             "calls_per_step": round(count[n] / steps, 2)} for n in ranked]


def device_summary(events, steps: int) -> dict:
    """One device plane's stream events: period, busy/idle, kernels, collectives, gaps."""
    kernels = [e for e in events if "stream" in e[0].lower()]
    if not kernels:
        return {"error": f"no stream lines: {sorted({e[0] for e in events})[:10]}"}
    cover = union([(s, e) for _, _, s, e in kernels])
    window = cover[-1][1] - cover[0][0]
    busy = sum(b - a for a, b in cover)
    gaps = sorted(((cover[i + 1][0] - cover[i][1]) / 1e3 for i in range(len(cover) - 1)),
                  reverse=True)
    nccl = [e for e in kernels if "nccl" in e[1].lower()]
    return {
        "period_us": round(window / 1e3 / steps, 1),
        "busy_us_per_step": round(busy / 1e3 / steps, 1),
        "idle_us_per_step": round((window - busy) / 1e3 / steps, 1),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "nccl_us_per_step": round(sum(e - s for _, _, s, e in nccl) / 1e3 / steps, 1),
        "nccl_calls_per_step": round(len(nccl) / steps, 1),
        "gaps_over_10us_per_step": round(sum(g > 10 for g in gaps) / steps, 1),
        "gap_us_over_10us_per_step": round(sum(g for g in gaps if g > 10) / steps, 1),
        "largest_gaps_us": [round(g, 1) for g in gaps[:8]],
        "top_kernels": by_name(kernels, steps, 15),
    }


def summarize(trace_dir: str, steps: int) -> dict:
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    planes = plane_events(path)
    out = {"devices": {}, "host": {}}
    for name, events in sorted(planes.items()):
        if name.startswith("/device:GPU:"):
            out["devices"][name] = device_summary(events, steps)
        elif name.startswith("/host:CPU"):
            own = ("$profiler.py", "$contextlib.py", "$trace_tp_step.py")  # the tracing itself
            mine = [e for e in events if not e[1].startswith(own)]
            out["host"] = {"top_events": by_name(mine, steps, 25),
                           "threads": sorted({e[0] for e in events})[:20]}
    return out


def cfg_len(model: str) -> int:
    return json.loads(Path(model, "config.json").read_text()).get("max_position_embeddings", 1024)


def build_llm(shape: str, tp: int, work: Path, decode_steps: int = 1):
    from jaxinfer.bench.presets import LLAMA3_8B, LLAMA3_70B
    from jaxinfer import LLM
    shapes = {"llama8b": LLAMA3_8B, "llama70b": LLAMA3_70B}
    model = shape
    if shape in shapes:
        model = str(work / shape)
        os.makedirs(model, exist_ok=True)
        Path(model, "config.json").write_text(json.dumps(shapes[shape]))
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, dtype="bfloat16", attention_backend=BACKEND,
              load_format="dummy" if shape in shapes else "auto", max_num_seqs=8,
              max_num_batched_tokens=512, max_model_len=min(1024, cfg_len(model)),
              num_blocks=1024, warmup=False, compilation_cache_dir=None,
              decode_steps_per_call=decode_steps)
    return llm, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps-per-call", type=int, default=1,
                    help="the engine's on-device decode loop (1: one step per dispatch)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TRACE_XLA_FLAGS}".strip()
    import jax

    from jaxinfer.bench.common import timed_generate
    label = args.label or f"{Path(args.shape).name}_tp{args.tp}"
    out_dir = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "tp_traces"))
    out_dir.mkdir(parents=True, exist_ok=True)
    llm, load_s = build_llm(args.shape, args.tp, Path(tempfile.mkdtemp(prefix="jaxinfer-trace-")),
                            args.decode_steps_per_call)
    engine = getattr(llm.engine, "replicas", [llm.engine])[0]
    prompt = [np.random.default_rng(0).integers(0, engine.cfg.vocab_size, args.prompt_len).tolist()]

    def run(n: int) -> float:
        return timed_generate(llm, prompt, n)

    first = run(9)
    short = min(run(9) for _ in range(2))
    steps0, host0 = engine.stats.steps, engine.stats.host_s
    gaps0, gap_s0 = engine.stats.sync_gaps, engine.stats.sync_gap_s
    long = run(9 + 64)
    steps = engine.stats.steps - steps0
    result = {"label": label, "tp": args.tp, "shape": args.shape, "load_s": round(load_s, 1),
              "decode_steps_per_call": args.decode_steps_per_call,
              "first_request_s": round(first, 1),
              "tpot_ms": round(1e3 * (long - short) / 64, 3),
              "host_ms_per_step": round(1e3 * (engine.stats.host_s - host0) / steps, 3),
              "sync_gaps": engine.stats.sync_gaps - gaps0,
              "sync_gap_ms": round(1e3 * (engine.stats.sync_gap_s - gap_s0), 2),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(json.dumps(result), flush=True)
    trace_dir = out_dir / label
    with jax.profiler.trace(str(trace_dir)):
        run(args.steps)
    result.update(summarize(str(trace_dir), args.steps))
    (out_dir / f"{label}.json").write_text(json.dumps(result, indent=1))
    print_summary(result)


def print_summary(r: dict) -> None:
    figures = ", ".join(f"{k} {r[k]}" for k in ("tpot_ms", "host_ms_per_step") if k in r)
    print(f"\n== {r['label']}: {figures}")
    for name, d in r["devices"].items():
        if "error" in d:
            print(name, d["error"])
            continue
        print(f"{name}: period {d['period_us']} µs, busy {d['busy_us_per_step']}, idle "
              f"{d['idle_us_per_step']}; {d['kernels_per_step']} kernels/step; NCCL "
              f"{d['nccl_us_per_step']} µs in {d['nccl_calls_per_step']} calls; gaps > 10 µs: "
              f"{d['gaps_over_10us_per_step']}/step = {d['gap_us_over_10us_per_step']} µs; "
              f"largest {d['largest_gaps_us']}")
        for k in d["top_kernels"]:
            print(f"   {k['us_per_step']:9.1f} µs  x{k['calls_per_step']:<6} {k['name']}")
    print("host events (µs per step, calls per step):")
    for k in r["host"].get("top_events", []):
        print(f"   {k['us_per_step']:9.1f} µs  x{k['calls_per_step']:<6} {k['name']}")


if __name__ == "__main__":
    main()
