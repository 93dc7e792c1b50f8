"""The device timeline of dense prefill calls, from jax's profiler (CUPTI): every kernel of a call,
its duration and the gap before it, for our flash kernel, the same kernel with its tile table built
by device ops inside the call (as the engine's ragged entry builds it), and cuDNN. It sets
kernel-only TF/s beside whole-call TF/s, and measures what the table costs a call.

    python -m jaxinfer.bench.profile.trace_prefill [--shapes 1x8192c,2x4096c,2x4096n] [--calls 4]

Shapes are BxL plus c (causal) or n (non-causal); Hq 32 / Hkv 8 / d 128, bf16, as in
`kernel_prefill.py`. Each implementation is compiled and warmed up, then runs 3 x `calls` calls under
`jax.profiler.trace`; the summary is `trace_decode.summarize`'s (the middle run). Traces are kept
under `--out` (default $OUT/prefill_traces).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path


import jax
import jax.numpy as jnp

from jaxinfer.bench.kernel_prefill import HKV, HQ, D, dense_flops
from jaxinfer.bench.profile.trace_decode import RUNS, device_events, summarize
from pallas_kernels.attention import flash_mgpu
from pallas_kernels.attention import flash_prefill as fp

SCALE = D ** -0.5


def table_on_device(q, k, v, starts, lens, *, causal: bool):
    """`fp.flash_attention` with the tile table built from runtime arrays (device ops in the call)
    instead of as a trace-time constant. L must be a multiple of 8."""
    b, l, hq, d = q.shape
    flat = lambda x: x.reshape(b * l, x.shape[2], d)
    tiles = fp.tile_table(starts, lens, lens, starts // 8, b * l, causal=causal)
    out = flash_mgpu.mosaic_attention(flat(q), flat(k), flat(v), tiles, jnp.zeros((1, 1), jnp.int32),
                                      kv_mode="contiguous", causal=causal, scale=SCALE,
                                      softcap=None)
    return out.reshape(b, l, hq, d)


def implementations(b: int, l: int, causal: bool) -> dict:
    """name -> (function of (q, k, v, starts, lens))."""
    return {
        "ours": lambda q, k, v, *_: fp.flash_attention(q, k, v, causal=causal, scale=SCALE),
        "ours_table_on_device": functools.partial(table_on_device, causal=causal),
        "cudnn": lambda q, k, v, *_: jax.nn.dot_product_attention(
            q, k, v, scale=SCALE, is_causal=causal, implementation="cudnn"),
    }


def timeline_row(events, calls: int, flops: float) -> dict:
    """The summary of one implementation's trace, plus its longest kernel (the attention kernel)
    and the TF/s of the whole call and of that kernel alone."""
    out = summarize(events, calls)
    if "error" in out:
        return out
    main, rec = max(out["kernels"].items(), key=lambda kv: kv[1]["mean_us"])
    others = sum(k["mean_us"] for name, k in out["kernels"].items() if name != main)
    return {**out, "main_kernel": main, "main_kernel_us": rec["mean_us"],
            "other_kernels_us": others,
            "TFLOPs_call": flops / out["period_us"] / 1e6,
            "TFLOPs_kernel": flops / rec["mean_us"] / 1e6}


def trace_shape(b: int, l: int, causal: bool, calls: int, out_dir: Path) -> dict:
    ks = jax.random.split(jax.random.key(b * l), 3)
    q = jax.random.normal(ks[0], (b, l, HQ, D), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, l, HKV, D), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:])
    starts = jnp.arange(b, dtype=jnp.int32) * l
    args = (q, k, v, starts, jnp.full((b,), l, jnp.int32))
    rows = {}
    for name, fn in implementations(b, l, causal).items():
        f = jax.jit(fn)
        for _ in range(2):
            jax.block_until_ready(f(*args))
        trace_dir = out_dir / f"{name}_B{b}_L{l}_{'c' if causal else 'n'}"
        with jax.profiler.trace(str(trace_dir)):
            for _ in range(RUNS * calls):
                out = f(*args)
            jax.block_until_ready(out)
        rows[name] = timeline_row(device_events(str(trace_dir)), calls, dense_flops(b, l, causal))
        print(f"B{b} L{l} {'causal' if causal else 'non-causal'} {name}: {json.dumps(rows[name])}",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x8192c,2x4096c,2x4096n")
    ap.add_argument("--calls", type=int, default=4, help="calls per traced run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "prefill_traces"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for shape in args.shapes.split(","):
        b, rest = shape.split("x")
        l, causal = int(rest[:-1]), rest[-1] == "c"
        results[shape] = trace_shape(int(b), l, causal, args.calls, out_dir)
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    print("\n| shape | implementation | call µs | TF/s | attention kernel µs | TF/s "
          "| other kernels µs |\n|---|---|---|---|---|---|---|")
    for shape, rows in results.items():
        for name, r in rows.items():
            if "error" in r:
                print(f"| {shape} | {name} | {r['error']} | | | | |")
                continue
            print(f"| {shape} | {name} | {r['period_us']:.1f} | {r['TFLOPs_call']:.1f} | "
                  f"{r['main_kernel_us']:.1f} | {r['TFLOPs_kernel']:.1f} | "
                  f"{r['other_kernels_us']:.1f} |")


if __name__ == "__main__":
    main()
