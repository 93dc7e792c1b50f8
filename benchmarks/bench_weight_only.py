"""The weight-only 8-bit decode matmul (pallas_kernels/weight_only_matmul.py) alone, on Llama-3-8B's
projection shapes, in TB/s of weight bytes beside the HBM read ceiling measured in the same run.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_weight_only.py [--deadline-s 30]
        [--rows 1,8,64] [--save [DIR]]

Each timed call runs the kernel over enough distinct copies of one shape's weights (>= 512 MB) that
nothing is served from L2, unrolled in one jit, as a decode step calls its layers. Figures:
`wo_<shape>_m<rows>_tbs` (the default tiling), the best of a small tiling sweep at 8 rows
(`wo_<shape>_m8_best_tbs`, `..._best_cfg`), XLA's weight-only dot (the path this kernel replaces)
at 8 rows, the bf16 LM head [in, out] through XLA's dot and through the kernel, and
`read_ceiling_tbs`: an XLA reduction over 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks import results_io

# name -> (N, K) of Llama-3-8B's projections (q, k, v fused: 6144 = 4096 + 2 x 1024).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
MIN_BYTES = 512 << 20
# (block_n, block_k, num_warps, num_stages, programs per SM for the split-K plan)
DEFAULT = (64, 256, 4, 4, 2)
SWEEP = [(32, 256, 4, 4, 2), (64, 512, 4, 3, 2), (128, 256, 4, 4, 2), (64, 256, 8, 4, 2),
         (64, 256, 4, 4, 4), (32, 512, 4, 4, 4), (128, 128, 4, 6, 2)]


def _median_s(fn, args, reps: int = 10) -> float:
    import jax
    import numpy as np
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def read_ceiling_tbs() -> float:
    """HBM read rate of an XLA reduction over 1 GiB (the ceiling a weight stream can reach)."""
    import jax
    import jax.numpy as jnp
    buf = jax.random.bits(jax.random.key(1), (1 << 28,), jnp.uint32)
    s = _median_s(jax.jit(lambda b: jnp.sum(b, dtype=jnp.uint32)), (buf,))
    del buf
    return (1 << 30) / s / 1e12


def _weights(n: int, k: int):
    """Distinct e4m3 weight copies (finite values: bytes in [-100, 100]) and one scale vector."""
    import jax
    import jax.numpy as jnp
    copies = max(1, -(-MIN_BYTES // (n * k)))
    make = jax.jit(lambda key: jax.lax.bitcast_convert_type(
        jax.random.randint(key, (n, k), -100, 101, jnp.int8), jnp.float8_e4m3fn))
    ws = [make(jax.random.key(i)) for i in range(copies)]
    return ws, jnp.full((n,), 1e-3, jnp.float32)


def _kernel_fn(cfg: tuple, n: int, k: int):
    import jax

    from pallas_kernels.device_info import num_sms
    from pallas_kernels.weight_only_matmul import plan_split_k, weight_only_matmul_configured
    bn, bk, warps, stages, per_sm = cfg
    split = plan_split_k(n, k, bn, bk, per_sm * num_sms())

    def run(x, s, *ws):
        return tuple(weight_only_matmul_configured(x, w, s, block_n=bn, block_k=bk, split_k=split,
                                                   num_warps=warps, num_stages=stages)
                     for w in ws)
    return jax.jit(run)


def _xla_dequant_fn():
    import jax

    from jaxinfer.model.quant.ops import quantized_matmul

    def run(x, s, *ws):
        return tuple(quantized_matmul(x, w, s, impl="dequant") for w in ws)
    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline-s", type=float, default=60.0,
                    help="stop starting new measurements past this many seconds")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="the default tiling only")
    results_io.add_save_arg(ap, "weight_only_<gpu>")
    args = ap.parse_args()
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    from pallas_kernels.weight_only_matmul import weight_only_matmul

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - start)

    m: dict = {"read_ceiling_tbs": round(read_ceiling_tbs(), 3)}
    print(json.dumps(m), flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    if "lm_head" in args.shapes.split(","):
        # The model's bf16 LM head ([in, out], XLA's dot) at the batch-1 bucket: what an unquantized
        # head costs a decode step beside the 8-bit layers.
        n, k = SHAPES["lm_head"]
        head = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(8), (8, k), jnp.bfloat16)
        sec = _median_s(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
                        (x, head))
        m["xla_bf16_lm_head_m8_tbs"] = round(2 * n * k / sec / 1e12, 3)
        m["xla_bf16_lm_head_m8_us"] = round(sec * 1e6, 1)
        sec = _median_s(jax.jit(lambda x, w: weight_only_matmul(x, w, None, w_kn=True)), (x, head))
        m["wo_bf16_lm_head_m8_tbs"] = round(2 * n * k / sec / 1e12, 3)  # the kernel on it
        m["wo_bf16_lm_head_m8_us"] = round(sec * 1e6, 1)
        print(json.dumps({k_: v for k_, v in m.items() if "lm_head" in k_}), flush=True)
        del head

    def save() -> None:
        if args.save:
            results_io.save(args.save, args.name or "weight_only_h200", metrics=m, config={
                "shapes": {s: SHAPES[s] for s in args.shapes.split(",")}, "rows": rows,
                "default_cfg": "block_n, block_k, warps, stages, programs/SM = "
                               + ",".join(map(str, DEFAULT)),
                "weights": "float8_e4m3fn, per-channel scales; >= 512 MB of copies per call"})

    def measure(key: str, fn, x, s, ws) -> float:
        sec = _median_s(fn, (x, s, *ws))
        tbs = len(ws) * ws[0].size / sec / 1e12
        m[key + "_tbs"] = round(tbs, 3)
        m[key + "_us"] = round(sec / len(ws) * 1e6, 2)
        print(json.dumps({key + "_tbs": m[key + "_tbs"], key + "_us": m[key + "_us"],
                          "at_s": round(time.perf_counter() - start, 1)}), flush=True)
        return tbs

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        if left() < 3:
            break
        ws, s = _weights(n, k)
        for r in rows:
            if left() < 2:
                break
            x = jax.random.normal(jax.random.key(r), (r, k), jnp.bfloat16)
            measure(f"wo_{name}_m{r}", _kernel_fn(DEFAULT, n, k), x, s, ws)
        save()
        del ws
    x8 = {}
    biggest_first = sorted(args.shapes.split(","), key=lambda s: -SHAPES[s][0] * SHAPES[s][1])
    for name in [s for s in biggest_first if s != "lm_head"]:  # the sweep at the bs-1 bucket
        if args.no_sweep or left() < 5:
            break
        n, k = SHAPES[name]
        ws, s = _weights(n, k)
        x8[name] = jax.random.normal(jax.random.key(8), (8, k), jnp.bfloat16)
        best = (m.get(f"wo_{name}_m8_tbs", 0.0), DEFAULT)
        for cfg in SWEEP:
            if left() < 2:
                break
            tbs = measure(f"wo_{name}_m8_cfg{'_'.join(map(str, cfg))}", _kernel_fn(cfg, n, k),
                          x8[name], s, ws)
            best = max(best, (tbs, cfg))
        m[f"wo_{name}_m8_best_tbs"] = round(best[0], 3)
        m[f"wo_{name}_m8_best_cfg"] = ",".join(map(str, best[1]))
        if left() > 3:
            measure(f"xla_dequant_{name}_m8", _xla_dequant_fn(), x8[name], s, ws)
        save()
        del ws
    for key in [k for k in m if k.endswith("_tbs") and k.startswith("wo_") and "_cfg" not in k]:
        m[key.replace("_tbs", "_frac_of_ceiling")] = round(m[key] / m["read_ceiling_tbs"], 3)
    m["wall_s"] = round(time.perf_counter() - start, 1)
    save()
    print("\n".join(f"{k} | {v}" for k, v in m.items() if not k.endswith("_us")))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
