"""Paged decode attention on the GPU: our kernels beside jax's bundled Pallas `paged_attention`, XLA
on a gathered contiguous cache, and the HBM read ceiling measured in the same run.

    python3 benchmarks/bench_decode.py [--batches 1,8,64,256] [--contexts 512,4096,32768]
                                       [--variants mosaic,triton] [--json PATH]

Figure of merit: TB/s of KV read = (K + V bytes of every sequence's context) / kernel time, and its
share of the read ceiling (a sum over 8 GiB of bf16, measured here). Timing: R calls inside one jit
(no host round trip between them), several repetitions, the median per call. When one call's KV
bytes fit in L2 the R calls read R disjoint page sets, so no call is served from the 60 MB L2.
Writes JSON to $OUT/bench_decode.json when $OUT is set (or --json). `bench_kernels.py` calls
`run_grid`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
import warnings

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.paged_decode import (MosaicDecodeConfig, paged_decode_mosaic_configured,
                                         paged_decode_triton_configured)

HQ, HKV, D, PAGE = 32, 8, 128, 16
L2_FLUSH_BYTES = 256 * 2**20  # read this much per measurement at least, so L2 (60 MB) can't serve it
MAX_SETS = 64


def read_ceiling_tbps() -> float:
    """HBM read bandwidth: sum over 8 GiB of bf16 (shared/gpu/probe_extra.py's anchor)."""
    x = jax.random.normal(jax.random.key(0), (4 * 1024**3,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    t = _median_time(lambda: f(x), reps=10)
    del x
    return x_bytes_tbps(8 * 1024**3, t)


def x_bytes_tbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e12


def _median_time(call, reps: int) -> float:
    jax.block_until_ready(call())  # compile + warm up
    jax.block_until_ready(call())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def make_paged_case(batch: int, ctx: int, *, seed: int = 0, hq=HQ, hkv=HKV, d=D, page=PAGE):
    """q, K/V pools and `sets` block tables over disjoint shuffled page sets (enough sets that one
    timed measurement reads >= L2_FLUSH_BYTES); all sequences hold exactly `ctx` tokens."""
    pages = ctx // page
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    sets = int(min(MAX_SETS, max(1, math.ceil(L2_FLUSH_BYTES / kv_bytes))))
    num_blocks = sets * batch * pages
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (hkv, num_blocks, page, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (hkv, num_blocks, page, d), jnp.bfloat16)
    bts = jax.random.permutation(ks[3], num_blocks).astype(jnp.int32).reshape(sets, batch, pages)
    lens = jnp.full((batch,), ctx, jnp.int32)
    return dict(q=q, k=k, v=v, bts=bts, lens=lens, kv_bytes=kv_bytes, sets=sets)


def time_paged(fn, case, reps: int = 7) -> float:
    """Median seconds per call of fn(q, k, v, block_table, lens), R calls per jit."""
    sets = case["sets"]
    r = max(sets, 4)

    @jax.jit
    def many(q, k, v, bts, lens):
        return [fn(q, k, v, bts[i % sets], lens) for i in range(r)]

    args = (case["q"], case["k"], case["v"], case["bts"], case["lens"])
    return _median_time(lambda: many(*args), reps) / r


def our_variants(scale: float) -> dict:
    """name -> fn(q, k, v, bt, lens) for the kernels of this repo in their benchmarked configs."""
    out = {}
    for tps in (64, 128):
        cfg = MosaicDecodeConfig(tokens_per_step=tps)
        out[f"mosaic_t{tps}"] = functools.partial(paged_decode_mosaic_configured, scale=scale,
                                                  config=cfg)
    out["triton"] = functools.partial(paged_decode_triton_configured, scale=scale)
    out["triton_p16_w8"] = functools.partial(paged_decode_triton_configured, scale=scale,
                                             pages_per_step=16, num_warps=8, num_stages=3)
    return out


def bundled_variants(scale: float) -> dict:
    """jax's bundled Triton-lowered paged_attention (deprecated) at a few block settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as pa
    out = {}
    for bh, ppcb, ksp in [(16, 8, 16), (16, 16, 8), (16, 4, 32)]:
        f = functools.partial(pa.paged_attention, block_h=bh, pages_per_compute_block=ppcb,
                              k_splits=ksp)
        out[f"bundled_p{ppcb}_k{ksp}"] = (lambda f: lambda q, k, v, bt, lens: f(
            (q * scale).astype(q.dtype), k, v, bt, lens))(f)
    return out


def time_xla_contiguous(case, scale: float, reps: int = 7) -> float:
    """XLA attention on the same context already gathered into contiguous [S, L, Hkv, D] arrays."""
    sets = min(case["sets"], 8)
    hkv, _, page, d = case["k"].shape
    ks, vs = [], []
    for i in range(sets):
        bt = case["bts"][i]
        ks.append(case["k"][:, bt].reshape(hkv, bt.shape[0], -1, d).transpose(1, 2, 0, 3))
        vs.append(case["v"][:, bt].reshape(hkv, bt.shape[0], -1, d).transpose(1, 2, 0, 3))
    ks, vs = jnp.stack(ks), jnp.stack(vs)
    r = max(sets, 4)

    @jax.jit
    def many(q, ks, vs):
        return [jax.nn.dot_product_attention(q[:, None], ks[i % sets], vs[i % sets], scale=scale,
                                             implementation="xla")[:, 0] for i in range(r)]

    t = _median_time(lambda: many(case["q"], ks, vs), reps) / r
    del ks, vs
    return t


def run_grid(batches, contexts, variants=("mosaic", "triton", "bundled", "xla"), log=print) -> dict:
    """Time every (batch, context) shape; returns a JSON-able dict with the ceiling and rows."""
    scale = D ** -0.5
    ceiling = read_ceiling_tbps()
    log(f"read ceiling {ceiling:.2f} TB/s")
    result = {"jax": jax.__version__, "device": str(jax.devices()[0]), "read_ceiling_TBps": ceiling,
              "shape": dict(hq=HQ, hkv=HKV, d=D, page=PAGE, dtype="bfloat16"), "rows": []}
    fns = {}
    if any(v in variants for v in ("mosaic", "triton")):
        fns.update({n: f for n, f in our_variants(scale).items() if n.split("_")[0] in variants})
    if "bundled" in variants:
        fns.update(bundled_variants(scale))
    for batch in batches:
        for ctx in contexts:
            kv_gb = 2 * batch * ctx * HKV * D * 2 / 1e9
            if kv_gb > 40:
                log(f"skip B{batch} ctx{ctx}: {kv_gb:.0f} GB of KV")
                continue
            case = make_paged_case(batch, ctx)
            row = {"batch": batch, "ctx": ctx, "kv_bytes": case["kv_bytes"], "sets": case["sets"],
                   "kernels": {}}
            for name, fn in fns.items():
                try:
                    t = time_paged(fn, case)
                    row["kernels"][name] = {"us": t * 1e6,
                                            "TBps": x_bytes_tbps(case["kv_bytes"], t)}
                except Exception as e:  # a variant that fails to compile at a shape is reported
                    row["kernels"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if "xla" in variants and kv_gb <= 8:
                try:
                    t = time_xla_contiguous(case, scale)
                    row["kernels"]["xla_contiguous"] = {"us": t * 1e6,
                                                        "TBps": x_bytes_tbps(case["kv_bytes"], t)}
                except Exception as e:
                    row["kernels"]["xla_contiguous"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            for rec in row["kernels"].values():
                if "TBps" in rec:
                    rec["pct_ceiling"] = 100 * rec["TBps"] / ceiling
            result["rows"].append(row)
            log(format_row(row))
            del case
    return result


def _best(row, prefix):
    ok = [(k, r) for k, r in row["kernels"].items() if k.startswith(prefix) and "us" in r]
    return min(ok, key=lambda kr: kr[1]["us"]) if ok else (None, None)


def format_row(row) -> str:
    parts = [f"B{row['batch']:>3} ctx{row['ctx']:>5}"]
    for name, rec in row["kernels"].items():
        parts.append(f"{name} " + (f"{rec['us']:.1f}us {rec['TBps']:.2f}TB/s" if "us" in rec
                                   else "ERR"))
    return " | ".join(parts)


def table(result) -> str:
    """Markdown table: best of each family per shape."""
    lines = ["| batch | ctx | KV MB | ours (best) | µs | TB/s | % ceiling | bundled best µs | TB/s "
             "| XLA contiguous µs | TB/s | Triton path µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        name, ours = _best(row, "mosaic")
        _, bun = _best(row, "bundled")
        _, tri = _best(row, "triton")
        xla = row["kernels"].get("xla_contiguous", {})
        f = lambda r, k, fmt: (fmt.format(r[k]) if r and k in r else "–")
        lines.append(f"| {row['batch']} | {row['ctx']} | {row['kv_bytes'] / 1e6:.0f} | {name} | "
                     f"{f(ours, 'us', '{:.1f}')} | {f(ours, 'TBps', '{:.2f}')} | "
                     f"{f(ours, 'pct_ceiling', '{:.0f}%')} | {f(bun, 'us', '{:.1f}')} | "
                     f"{f(bun, 'TBps', '{:.2f}')} | {f(xla, 'us', '{:.1f}')} | "
                     f"{f(xla, 'TBps', '{:.2f}')} | {f(tri, 'us', '{:.1f}')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--variants", default="mosaic,triton,bundled,xla")
    ap.add_argument("--json", default=None, help="output path (default: $OUT/bench_decode.json)")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    result = run_grid(ints(args.batches), ints(args.contexts), tuple(args.variants.split(",")),
                      log=lambda s: print(s, flush=True))
    path = args.json or (os.path.join(os.environ["OUT"], "bench_decode.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
