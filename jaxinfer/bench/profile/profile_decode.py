"""Where a paged-decode call's time goes, from Mosaic GPU's in-kernel profiler (on the H200).

    python -m jaxinfer.bench.profile.profile_decode [--shapes 1x32768,64x4096] [--variants mosaic]

For each shape (Hq 32 / Hkv 8 / d 128 / page 16, every sequence at full context) the kernel runs
once unprofiled (compile, warm-up) and once with `MosaicDecodeConfig.profile_dir` set: every
warpgroup of every CTA records global-timer stamps at the kernel's named ranges (producer_item,
wait_q, kv_steps, hand_over, merge_store with its wait_x; per step the producer's wait_free and the
consumers' wait_k, qk, softmax, wait_v, pv and, on an fp8 cache (`--fp8`), widen; the event
buffers take the shared memory the ring leaves, a few hundred events, so each warpgroup records
its first ~20-60 steps; SM cycles within a warpgroup, converted to µs at the maximum SM clock).
From that trace this prints, per shape: the kernel's
span (first stamp to last, over all CTAs), how far apart the CTAs start and finish, when the first
consumer starts streaming (the end of its q wait), and each range's mean and max length. The
profiler's own stores cost a few cycles per stamp; the split-combine kernel (several splits) and the launch
before the first stamp are outside the trace. Then, per warpgroup role, µs per step in each range
(`step_breakdown`). Traces (Perfetto JSON) and a summary JSON go under $OUT/decode_profiles (or
--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np


import jax

from jaxinfer.bench.kernel_decode import D, make_paged_case, mosaic_config
from pallas_kernels.attention.paged_decode import paged_decode_mosaic

CONSUMERS = 2  # warpgroups 0 and 1; then the producer (and, fp8, the V producer)


def sm_clock_ghz() -> float:
    """The GPU's maximum SM clock (nvidia-smi), at which a busy H200 runs; 1.98 if unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return float(out.stdout.split()[0]) / 1e3
    except (OSError, ValueError, IndexError):
        return 1.98


def to_microseconds(events: list[dict], clock_ghz: float) -> list[dict]:
    """Mosaic's dump writes ts = (global timer at a trace's start, ns + SM cycles since its first
    stamp) / 1e3: the first stamp of each trace (one warpgroup of one CTA) is a global time in µs,
    the others add kilocycles. Convert those to µs at `clock_ghz`."""
    first: dict[int, float] = {}
    for e in events:
        first[e["tid"]] = min(first.get(e["tid"], e["ts"]), e["ts"])
    return [{**e, "ts": first[e["tid"]] + (e["ts"] - first[e["tid"]]) / clock_ghz}
            for e in events]


def summarize(events: list[dict], warpgroups: int = 3) -> dict:
    """Perfetto events of one call (ph B/E, ts in µs, tid = 1 + warpgroups * cta + warpgroup) ->
    figures."""
    open_at: dict[tuple[int, str], list[float]] = defaultdict(list)
    spans: dict[str, list[float]] = defaultdict(list)
    first_stream: list[float] = []
    cta_first: dict[int, float] = {}
    cta_last: dict[int, float] = {}
    for e in sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B")):
        cta, wg = divmod(e["tid"] - 1, warpgroups)
        cta_first[cta] = min(cta_first.get(cta, e["ts"]), e["ts"])
        cta_last[cta] = max(cta_last.get(cta, e["ts"]), e["ts"])
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key].append(e["ts"])
        elif open_at[key]:
            start = open_at[key].pop()
            spans[e["name"]].append(e["ts"] - start)
            if e["name"] == "wait_q" and wg < CONSUMERS:
                first_stream.append(e["ts"])
    if not cta_first:
        return {"error": "empty trace"}
    t0 = min(cta_first.values())
    firsts = np.array(list(cta_first.values())) - t0
    lasts = np.array(list(cta_last.values())) - t0
    return {
        "ctas": len(cta_first),
        "span_us": float(lasts.max()),
        "cta_start_spread_us": float(firsts.max() - firsts.min()),
        "cta_finish_min_us": float(lasts.min()),
        "cta_finish_median_us": float(np.median(lasts)),
        "first_q_ready_us": float(min(first_stream) - t0) if first_stream else None,
        "ranges_us": {name: {"n": len(v), "mean": float(np.mean(v)), "max": float(np.max(v))}
                      for name, v in sorted(spans.items())},
    }


ROLES = ("consumer 0", "consumer 1", "producer", "V producer")  # by warpgroup index


def step_breakdown(events: list[dict], warpgroups: int = 3) -> dict:
    """Per warpgroup role (consumer 0 / 1, producer, V producer), over all CTAs: µs per pipeline
    step of each range's self time (its length less the ranges nested in it, e.g. the widening
    inside `qk`; the self time of `kv_steps` / `producer_item` is a step's unnamed work: loop
    overhead, the producer's copy issue). Steps: a consumer's `wait_k` count; the producer's
    `wait_free` count over the caches it loads (2, or 1 beside a V producer; the ring's first
    fill has no wait, so the producer's figures are per steady-state step)."""
    self_time: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    stacks: dict[int, list] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B")):
        role = ROLES[(e["tid"] - 1) % warpgroups]
        stack = stacks[e["tid"]]
        if e["ph"] == "B":
            stack.append([e["name"], e["ts"], 0.0])  # name, start, time in nested ranges
        elif stack and stack[-1][0] == e["name"]:
            name, start, nested = stack.pop()
            self_time[role][name] += e["ts"] - start - nested
            counts[role][name] += 1
            if stack:
                stack[-1][2] += e["ts"] - start
    caches = 1 if warpgroups > 3 else 2
    out = {}
    for role, times in self_time.items():
        c = counts[role]
        steps = c.get("wait_k", 0) if role.startswith("consumer") else c.get("wait_free", 0) // (
            1 if role == "V producer" else caches)
        if steps:
            out[role] = {"steps": steps, "us_per_step": {k: v / steps for k, v in times.items()},
                         "count_per_step": {k: n / steps for k, n in c.items()}}
    return out


def breakdown_table(breakdown: dict) -> str:
    """`step_breakdown` as a table: ranges down, roles across, µs per step."""
    roles = [r for r in ROLES if r in breakdown]
    names = sorted({n for r in roles for n in breakdown[r]["us_per_step"]})
    rows = ["| range | " + " | ".join(roles) + " |", "|---" * (len(roles) + 1) + "|",
            "| steps seen | " + " | ".join(str(breakdown[r]["steps"]) for r in roles) + " |"]
    for name in names:
        rows.append(f"| {name} | " + " | ".join(
            f"{breakdown[r]['us_per_step'][name]:.3f}" if name in breakdown[r]["us_per_step"]
            else "" for r in roles) + " |")
    rows.append("| sum per step | " + " | ".join(
        f"{sum(breakdown[r]['us_per_step'].values()):.3f}" for r in roles) + " |")
    return "\n".join(rows)


def profile_shape(batch: int, ctx: int, variant: str, out_dir: Path, fp8: bool = False) -> dict:
    case = make_paged_case(batch, ctx)
    if fp8:  # the same pages as an fp8 cache (kv_quant.py)
        from pallas_kernels.attention.kv_quant import quantize
        case = dict(case, k=quantize(case["k"], 1.0), v=quantize(case["v"], 1.0))
        from jaxinfer.bench.kernel_decode import fp8_variant_config
        config = fp8_variant_config(variant)  # the fp8 options too (qk, wid, late, ...)
        variant += ":fp8"
    else:
        config = mosaic_config(variant)
    trace_dir = out_dir / f"{variant.replace(':', '_')}_B{batch}_ctx{ctx}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    args = (case["q"], case["k"], case["v"], case["bts"][0], case["lens"])
    call = functools.partial(paged_decode_mosaic, scale=D ** -0.5)
    jax.block_until_ready(jax.jit(functools.partial(call, config=config))(*args))
    profiled = jax.jit(functools.partial(
        call, config=dataclasses.replace(config, profile_dir=str(trace_dir))))
    jax.block_until_ready(profiled(*args))
    warpgroups = 3  # the kernel's: two consumers and a producer (paged_decode_mosaic.py)
    return {**read_trace(trace_dir, warpgroups), "batch": batch, "ctx": ctx, "variant": variant}


def read_trace(trace_dir: Path, warpgroups: int = 3) -> dict:
    """`summarize` of the newest Mosaic GPU profile under trace_dir (written by a host callback of
    a profiled call just made), with the trace's path and the SM clock used; {"error": ...} if the
    call wrote none."""
    jax.effects_barrier()
    traces = sorted(glob.glob(str(trace_dir / "*-trace.json")))
    if not traces:
        return {"error": f"no trace written under {trace_dir}"}
    with open(traces[-1]) as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    clock = sm_clock_ghz()
    events = to_microseconds([e for e in events if e.get("ph") in ("B", "E")], clock)
    return {**summarize(events, warpgroups), "steps": step_breakdown(events, warpgroups),
            "trace": traces[-1], "sm_clock_ghz": clock}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,8x32768,64x4096")
    ap.add_argument("--variants", default="mosaic", help="kernel_decode.py variant names")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8", action="store_true", help="also profile each on an fp8 cache")
    ap.add_argument("--fp8-only", action="store_true",
                    help="profile each on an fp8 cache only (variants may use the fp8 options of "
                         "kernel_decode.fp8_variant_config)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "decode_profiles"))
    rows = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        for variant in args.variants.split(","):
            for fp8 in (True,) if args.fp8_only else (False, True) if args.fp8 else (False,):
                row = profile_shape(batch, ctx, variant, out_dir, fp8)
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    print("\n| shape | variant | CTAs | span µs | CTA start spread | CTA finish min / median / max "
          "| first q ready | kv_steps mean / max | merge_store mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r.get('batch')}x{r.get('ctx')} | {r.get('variant')} | {r['error']} |")
            continue
        kv = r["ranges_us"].get("kv_steps", {})
        ms = r["ranges_us"].get("merge_store", {})
        print(f"| {r['batch']}x{r['ctx']} | {r['variant']} | {r['ctas']} | {r['span_us']:.1f} | "
              f"{r['cta_start_spread_us']:.1f} | {r['cta_finish_min_us']:.1f} / "
              f"{r['cta_finish_median_us']:.1f} / {r['span_us']:.1f} | "
              f"{r['first_q_ready_us'] or 0:.1f} | {kv.get('mean', 0):.1f} / {kv.get('max', 0):.1f} | "
              f"{ms.get('mean', 0):.2f} |")
    for r in rows:  # where each warpgroup's step goes
        if r.get("steps"):
            print(f"\n{r['batch']}x{r['ctx']} {r['variant']}: µs per step (self time; the first "
                  f"events of each warpgroup)\n" + breakdown_table(r["steps"]))


if __name__ == "__main__":
    main()
