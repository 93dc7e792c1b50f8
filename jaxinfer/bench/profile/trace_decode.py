"""The device timeline of chained paged-decode calls, from jax's profiler (CUPTI): every kernel of a
call, its duration and the idle gap before it, so the time a call spends outside the decode kernel
(the split combine, launch gaps) is measured rather than inferred.

    python -m jaxinfer.bench.profile.trace_decode [--shapes 1x32768,8x32768] [--variants mosaic]
                                                    [--lens 64]

For each shape (Hq 32 / Hkv 8 / d 128 / page 16, full context, the same chained jit as
`kernel_decode.py`: each call's q is the previous call's output, page sets cycled past L2) the jit
runs once to compile and warm up, then 3 times under `jax.profiler.trace`. From the GPU plane of the
trace it prints, per kernel of a call (in launch order), its mean duration and the mean signed gap
before it, and the mean period of one call; `--out` keeps the trace (default $OUT/decode_traces).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np


import jax

from jaxinfer.bench.kernel_decode import D, chained_calls, make_paged_case, mosaic_config
from pallas_kernels.attention.paged_decode import paged_decode_mosaic

RUNS = 3


def device_events(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, end_ns) of every event on the first GPU plane's stream lines, by start."""
    from jax._src.lib import _profile_data
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    data = _profile_data.ProfileData.from_file(path)
    plane = next((p for p in data.planes if p.name.startswith("/device:GPU:")), None)
    if plane is None:
        raise RuntimeError(f"no GPU plane in {path}: planes {[p.name for p in data.planes]}")
    events = [(e.name, e.start_ns, e.end_ns) for line in plane.lines
              if "stream" in line.name.lower() for e in line.events]
    if not events:
        raise RuntimeError(f"no stream events on {plane.name}: lines {[l.name for l in plane.lines]}")
    return sorted(events, key=lambda e: e[1])


def summarize(events: list[tuple[str, int, int]], calls: int) -> dict:
    """Per kernel of a call, in launch order ("<position>:<name>", as two kernels may share a
    name): mean µs, and the mean signed gap from the previous kernel's end to its start (µs;
    negative = it started before the previous one ended, e.g. launched early through PDL); the
    period per call over the middle run (the first and last may include host-side start and
    end)."""
    per_run = len(events) // RUNS
    if per_run == 0 or per_run % calls:
        return {"error": f"{len(events)} device events do not split into {RUNS} x {calls} calls"}
    middle = events[per_run:2 * per_run]
    per_call = per_run // calls
    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"dur": [], "gap": []})
    for i, (name, start, end) in enumerate(middle):
        entry = stats[f"{i % per_call}:{name[:60]}"]
        entry["dur"].append((end - start) / 1e3)
        if i:
            entry["gap"].append((start - middle[i - 1][2]) / 1e3)
    period = (middle[-1][2] - middle[0][1]) / 1e3 / calls
    return {
        "period_us": period,
        "kernels": {name: {"mean_us": float(np.mean(v["dur"])),
                           "gap_before_us": float(np.mean(v["gap"])) if v["gap"] else 0.0}
                    for name, v in stats.items()},
    }


def trace_shape(batch: int, ctx: int, variant: str, out_dir: Path,
                lens: int | None = None) -> dict:
    case = make_paged_case(batch, ctx)
    if lens is not None:  # the ctx shape's grid and split plan, but only `lens` tokens to stream
        case["lens"] = jax.numpy.full((batch,), lens, jax.numpy.int32)
    fn = functools.partial(paged_decode_mosaic, scale=D ** -0.5,
                           config=mosaic_config(variant))
    chain, call = case["chain"], chained_calls(fn, case)
    q = jax.block_until_ready(call(case["q"]))
    trace_dir = out_dir / f"{variant.replace(':', '_')}_B{batch}_ctx{ctx}_len{lens or ctx}"
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(RUNS):
            q = call(q)
        jax.block_until_ready(q)
    return {"batch": batch, "ctx": ctx, "lens": lens or ctx, "variant": variant, "chain": chain,
            **summarize(device_events(str(trace_dir)), chain)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,8x32768")
    ap.add_argument("--variants", default="mosaic", help="kernel_decode.py variant names")
    ap.add_argument("--lens", type=int, default=None,
                    help="sequence length (default: the full context): with a short one, the call "
                         "keeps the context's grid and split plan, so its time is the fixed cost")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "decode_traces"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        for variant in args.variants.split(","):
            results.append(trace_shape(batch, ctx, variant, out_dir, args.lens))
            print(json.dumps(results[-1]), flush=True)
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"\n{r['batch']}x{r['ctx']} (lens {r['lens']}) {r['variant']}: "
              f"{r.get('period_us', 0):.1f} µs per call "
              f"({r['chain']} calls chained)")
        print("| position:kernel | mean µs | gap before, µs (< 0: overlap) |\n|---|---|---|")
        for name, k in r.get("kernels", {}).items():
            print(f"| {name} | {k['mean_us']:.2f} | {k['gap_before_us']:.2f} |")


if __name__ == "__main__":
    main()
