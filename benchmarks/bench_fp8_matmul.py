"""The FP8 weight-streaming kernel (pallas_kernels/matmul/fp8_matmul_mosaic.py) per Llama-3-8B projection
at decode row counts, against XLA's weight-only dot (what decode steps run now), XLA's W8A8 gemm and
the HBM read ceiling measured in the same run; correctness first.

    PYTHONUNBUFFERED=1 python -m benchmarks.bench_fp8_matmul [--rows 1,8]
        [--configs 128/128/6/0,256/128/4/0,...] [--deadline-s 120] [--save [DIR]]
    JAX_PLATFORMS=cpu python -m benchmarks.bench_fp8_matmul --tiny   # CPU check

Per shape (the fused layout the engine serves on one GPU: qkv, o, gate_up, down), in order:
  check   `quantized_matmul` impl "mosaic" with each config against impl "fp8" (the same W8A8
          arithmetic through XLA) and against the float32 product of the dequantized operands, on
          one weight at every row count: `check_<shape>_m<r>_<cfg>` = (max rel. error vs fp8,
          rel. Frobenius error vs fp8); a config that fails the check is not timed;
  time    each impl over enough distinct weight copies (>= 512 MB, nothing served from L2), calls
          unrolled in one jit and queued (bench_weight_only's timing): `<impl>_<shape>_m<r>_us`
          per call (x quantized per token, matmul, epilogue: what one projection costs in a step)
          and `_tbs` (weight bytes / time), `_of_ceiling` (over `read_ceiling_tbs`).
Configs: block_n/block_k/stages/splits (splits 0: `choose_splits`). A table comes last; the record
(fp8_matmul_<gpu>) is rewritten after every shape.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks import results_io

# name -> (N, K) of Llama-3-8B's projections as the engine serves them (q/k/v and gate/up fused).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TINY_SHAPES = {"qkv": (384, 256), "down": (256, 512)}
CONFIGS = "128/128/6/0,256/128/4/0,128/256/3/0,128/128/8/1"


def parse_config(spec: str):
    from pallas_kernels.matmul.fp8_matmul_mosaic import Fp8Config
    bn, bk, stages, splits = (int(v) for v in spec.split("/"))
    return Fp8Config(bn, bk, stages, splits)


def impl_fn(impl: str, config=None, interpret: bool = False):
    """jit(x, s, *ws) -> one projection per weight copy, through `quantized_matmul` (impl "fp8" or
    "dequant") or the kernel with `config` (x quantized per token, as impl "mosaic" runs it)."""
    import jax

    from jaxinfer.model.quant.ops import quantize_tokens, quantized_matmul
    from pallas_kernels.matmul.fp8_matmul_mosaic import fp8_matmul
    if impl != "mosaic":
        return jax.jit(lambda x, s, *ws: tuple(quantized_matmul(x, w, s, impl=impl) for w in ws))

    def mosaic(x, s, *ws):
        xq, xs = quantize_tokens(x)
        return tuple(fp8_matmul(xq, xs[:, 0], w, s, config=config, interpret=interpret)
                     for w in ws)
    return jax.jit(mosaic)


def check(fn, x, s, w) -> tuple[float, float]:
    """(max |err| / max |ref|, ||err|| / ||ref||) of fn against impl "fp8" on one weight."""
    import numpy as np
    got = np.asarray(fn(x, s, w)[0], np.float32)
    ref = np.asarray(impl_fn("fp8")(x, s, w)[0], np.float32)
    err = np.abs(got - ref)
    return (round(float(err.max() / np.abs(ref).max()), 5),
            round(float(np.linalg.norm(err) / np.linalg.norm(ref)), 5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--configs", default=CONFIGS, help="block_n/block_k/stages/splits, ...")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--tiny", action="store_true", help="small shapes, the interpreter (CPU)")
    results_io.add_save_arg(ap, "fp8_matmul_<gpu>")
    args = ap.parse_args()
    start = time.perf_counter()

    import jax

    from benchmarks import bench_weight_only
    from benchmarks.bench_decode import read_ceiling_tbps
    from benchmarks.bench_weight_only import _timed, _weights
    if args.tiny:
        bench_weight_only.MIN_BYTES = 1  # one weight copy: the CPU run checks, it does not time

    shapes = TINY_SHAPES if args.tiny else {n: SHAPES[n] for n in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    configs = {c: parse_config(c) for c in args.configs.split(",")}
    m: dict = {"read_ceiling_tbs": round(read_ceiling_tbps(64 << 20 if args.tiny else 8 << 30), 3)}
    table = []
    print(json.dumps(m), flush=True)

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - start)

    def save() -> None:
        m["wall_s"] = round(time.perf_counter() - start, 1)
        if args.save:
            results_io.save(args.save, args.name or f"fp8_matmul_{results_io.device_slug()}",
                            metrics=m, config={"shapes": shapes, "rows": rows,
                                               "configs": list(configs), "tiny": args.tiny})

    for name, (n, k) in shapes.items():
        if left() < 5:
            m[f"{name}_skipped"] = "deadline"
            continue
        ws, s = _weights(n, k)
        for r in rows:
            x = jax.random.normal(jax.random.key(r), (r, k), jax.numpy.bfloat16)
            fns = {"dequant": impl_fn("dequant"), "fp8": impl_fn("fp8")}
            for c, cfg in configs.items():
                key = f"check_{name}_m{r}_{c}"
                try:
                    fn = impl_fn("mosaic", cfg, args.tiny)
                    m[key] = check(fn, x, s, ws[0])
                    if m[key][1] < 1e-2:
                        fns[f"mosaic_{c}"] = fn
                except Exception as e:  # one config failing must not lose the rest
                    m[key] = repr(e)[:300]
                print(key, m[key], flush=True)
            for impl, fn in fns.items():
                if left() < 2:
                    break
                key = f"{impl}_{name}_m{r}"
                sec = _timed(fn, x, s, *ws)
                tbs = len(ws) * ws[0].size / sec / 1e12
                m.update({key + "_us": round(sec / len(ws) * 1e6, 2), key + "_tbs": round(tbs, 3),
                          key + "_of_ceiling": round(tbs / m["read_ceiling_tbs"], 3)})
                table.append((name, r, impl, m[key + "_us"], m[key + "_tbs"],
                              m[key + "_of_ceiling"]))
                print(key, m[key + "_us"], "us", m[key + "_tbs"], "TB/s", flush=True)
        save()
        del ws
    save()
    print(f"{'shape':8} {'rows':>4} {'impl':26} {'us':>8} {'TB/s':>6} {'of_ceil':>7}   "
          f"(read ceiling {m['read_ceiling_tbs']} TB/s)")
    for row in table:
        print(f"{row[0]:8} {row[1]:4d} {row[2]:26} {row[3]:8.2f} {row[4]:6.3f} {row[5]:7.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
