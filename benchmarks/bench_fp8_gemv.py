"""The FP8 weight-only GEMV kernel (pallas_kernels/fp8_gemv.py) against XLA's weight-only dot on
Llama-3-8B's decode projections, over a small sweep of tilings, beside the HBM read ceiling
measured in the same run.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_fp8_gemv.py [--rows 1,8]
        [--shapes gate_up,down,qkv,o] [--candidates 6] [--deadline-s 110] [--save [DIR]]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/bench_fp8_gemv.py --tiny   # CPU check

Shapes [N, K] as the engine serves them on one GPU (q/k/v and gate/up fused): gate_up
[28672, 4096], down [4096, 14336], qkv [6144, 4096], o [4096, 4096]. For each row count (the
one-row decode bucket first: batch 1's case), each shape: XLA's dot over the converted weight
(`quantized_matmul` impl "dequant", what the step ran before the kernel), then up to
`--candidates` tilings of the kernel (the module's current choice, `config_for`, first). Each
timed call runs over enough distinct weight copies (>= 512 MB) that L2 serves none of them
(bench_weight_only's `_weights` and queued timing). Per entry: `us` per projection, `tbs` (weight
bytes over that) and `of_ceiling`; per kernel candidate also `rel_err` (max abs error over the
max of the float32 oracle, `fp8_gemv_reference`) or `error`. `best` is the fastest candidate with
rel_err < 1e-2; `suggested_tuned` lists the winners as `fp8_gemv.TUNED` entries, ready to paste.
`layer_us_m{rows}`: one layer's four projections, XLA's against the best tilings. Every candidate
runs in try/except and the deadline skips what would not finish; the record (fp8_gemv_<gpu>) is
rewritten after each shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import results_io  # noqa: E402

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
TINY_SHAPES = {"gate_up": (448, 256), "down": (256, 224), "qkv": (96, 256), "o": (256, 256)}
MAX_REL_ERR = 1e-2


def candidates(m: int, n: int, k: int, limit: int, sms: int) -> list:
    """The module's tiling for (m, n, k) first, then a few around it: for one row FMAs on small
    tiles with K split until the grid has a few programs per SM (and one with Triton's
    pipelining, one on tensor cores); for more rows tensor-core tiles of several shapes and one
    FMA tiling."""
    import jax.experimental.pallas as pl

    from pallas_kernels.fp8_gemv import GemvConfig as C
    from pallas_kernels.fp8_gemv import config_for

    def split(bn: int, bk: int, per_sm: int) -> int:
        return max(1, min(pl.cdiv(per_sm * sms, pl.cdiv(n, bn)), pl.cdiv(k, bk)))

    if m == 1:
        more = [C(16, 512, 4, 1, split(16, 512, 4)), C(32, 512, 4, 1, split(32, 512, 2)),
                C(8, 1024, 4, 1, split(8, 1024, 2)), C(16, 512, 4, 3, split(16, 512, 2)),
                C(64, 256, 4, 3, split(64, 256, 2), True)]
    else:
        more = [C(64, 256, 4, 3, split(64, 256, 2), True), C(64, 256, 4, 4, split(64, 256, 4), True),
                C(32, 256, 4, 3, split(32, 256, 2), True), C(128, 128, 4, 3, split(128, 128, 2), True),
                C(16, 512, 4, 1, split(16, 512, 2))]
    out = []
    for cfg in [config_for(m, n, k), *more]:
        # Blocks no larger than the (tiny) shape; K split no finer than one block per split.
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, max(32, 1 << (k - 1).bit_length())))
        cfg = dataclasses.replace(cfg, split_k=min(cfg.split_k, pl.cdiv(k, cfg.block_k)))
        if cfg not in out:
            out.append(cfg)
    return out[:limit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8", help="row counts, in order")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of: " + ",".join(SHAPES))
    ap.add_argument("--candidates", type=int, default=6, help="kernel tilings per shape")
    ap.add_argument("--deadline-s", type=float, default=110.0,
                    help="stop starting new measurements past this many seconds")
    ap.add_argument("--tiny", action="store_true",
                    help="small shapes, the kernel in Pallas' interpreter (CPU check)")
    results_io.add_save_arg(ap, "fp8_gemv_<gpu>")
    args = ap.parse_args()
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    from benchmarks.bench_decode import read_ceiling_tbps
    from benchmarks.bench_weight_only import MIN_BYTES, _timed, _weights
    from jaxinfer.model.quant.ops import quantized_matmul
    from pallas_kernels.device_info import num_sms
    from pallas_kernels.fp8_gemv import fp8_gemv_configured, fp8_gemv_reference

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - start)

    shapes = TINY_SHAPES if args.tiny else SHAPES
    names = [s for s in args.shapes.split(",") if s]
    rows = [int(r) for r in args.rows.split(",")]
    interpret = args.tiny or jax.devices()[0].platform != "gpu"
    m: dict = {"read_ceiling_tbs": round(read_ceiling_tbps(64 << 20 if args.tiny else 8 << 30), 3)}
    ceiling = m["read_ceiling_tbs"]
    print(json.dumps(m), flush=True)
    suggested: dict[str, str] = {}
    config = {"shapes": {s: shapes[s] for s in names}, "rows": rows, "interpret": interpret,
              "candidates": args.candidates,
              "weights": "float8_e4m3fn, per-channel scales; >= 512 MB of copies per call"}

    def save() -> None:
        m["wall_s"] = round(time.perf_counter() - start, 1)
        m["suggested_tuned"] = suggested
        for r in rows:
            entries = [m.get(f"{s}_m{r}", {}) for s in names]
            if all("xla" in e and "best" in e for e in entries):
                m[f"layer_us_m{r}"] = {
                    "xla": round(sum(e["xla"]["us"] for e in entries), 2),
                    "gemv_best": round(sum(e["candidates"][e["best"]]["us"] for e in entries), 2)}
        if args.save:
            results_io.save(args.save, args.name or f"fp8_gemv_{results_io.device_slug()}",
                            config=config, metrics=m)

    def timing(fn, x, s, ws) -> dict:
        sec = _timed(fn, x, s, *ws) / len(ws)
        tbs = ws[0].size / sec / 1e12
        return dict(us=round(sec * 1e6, 2), tbs=round(tbs, 3), of_ceiling=round(tbs / ceiling, 3))

    xla = jax.jit(lambda x, s, *ws: tuple(quantized_matmul(x, w, s, impl="dequant") for w in ws))
    for r in rows:
        for name in names:
            if left() < 4:
                m[f"{name}_m{r}_skipped"] = "deadline"
                continue
            n, k = shapes[name]
            entry: dict = {"candidates": {}}
            m[f"{name}_m{r}"] = entry
            try:
                ws, s = _weights(n, k, 1 if args.tiny else MIN_BYTES)
                x = jax.random.normal(jax.random.key(r), (r, k), jnp.bfloat16)
                want = fp8_gemv_reference(x, ws[0], s, jnp.float32)
                peak = float(jnp.abs(want).max())
                entry["xla"] = timing(xla, x, s, ws)
            except Exception as e:  # noqa: BLE001 - the other shapes still run
                entry["error"] = repr(e)[:300]
                print(name, r, "error", entry["error"], flush=True)
                continue
            for cfg in candidates(r, n, k, args.candidates, num_sms()):
                if left() < 3:
                    entry["candidates"][str(cfg)] = {"skipped": "deadline"}
                    continue
                try:
                    y = fp8_gemv_configured(x, ws[0], s, cfg=cfg, out_dtype=jnp.float32,
                                            interpret=interpret)
                    err = float(jnp.abs(y - want).max()) / max(peak, 1e-30)
                    fn = jax.jit(lambda x, s, *ws, cfg=cfg: tuple(
                        fp8_gemv_configured(x, w, s, cfg=cfg, interpret=interpret) for w in ws))
                    entry["candidates"][str(cfg)] = {**timing(fn, x, s, ws),
                                                     "rel_err": float(f"{err:.3g}")}
                except Exception as e:  # noqa: BLE001 - a tiling that fails to compile or run
                    entry["candidates"][str(cfg)] = {"error": repr(e)[:300]}
                print(name, r, cfg, entry["candidates"][str(cfg)], flush=True)
            ok = {c: v for c, v in entry["candidates"].items()
                  if "us" in v and v["rel_err"] < MAX_REL_ERR}
            if ok:
                best = min(ok, key=lambda c: ok[c]["us"])
                entry["best"] = best
                entry["speedup_vs_xla"] = round(entry["xla"]["us"] / ok[best]["us"], 3)
                cfg = next(c for c in candidates(r, n, k, args.candidates, num_sms())
                           if str(c) == best)
                suggested[name + f"_m{r}"] = f"({1 if r <= 1 else 8}, {n}, {k}): {cfg!r},"
            del ws
            save()
    save()
    print(f"{'shape':10} {'rows':>4} {'xla_us':>8} {'xla_TB/s':>8} {'best tiling':28} "
          f"{'us':>8} {'TB/s':>6} {'of_ceil':>7} {'x_xla':>6}   (read ceiling {ceiling} TB/s)")
    for r in rows:
        for name in names:
            e = m.get(f"{name}_m{r}", {})
            if "xla" not in e:
                continue
            b = e["candidates"].get(e.get("best"), {})
            print(f"{name:10} {r:4d} {e['xla']['us']:8.2f} {e['xla']['tbs']:8.3f} "
                  f"{e.get('best', '-'):28} {b.get('us', float('nan')):8.2f} "
                  f"{b.get('tbs', float('nan')):6.3f} {b.get('of_ceiling', float('nan')):7.3f} "
                  f"{e.get('speedup_vs_xla', float('nan')):6.3f}")
    for r in rows:
        if f"layer_us_m{r}" in m:
            print(f"one layer's projections at {r} rows (us): {m[f'layer_us_m{r}']}")
    print("suggested fp8_gemv.TUNED entries:\n    " + "\n    ".join(suggested.values()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
